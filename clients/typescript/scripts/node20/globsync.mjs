// Node 20 lacks fs.globSync (added in Node 22), which the MCP conformance
// suite imports by name. `node --import ./scripts/node20/globsync.mjs` gives
// modules that import `fs` a namespace with a small globSync added; on a Node
// that has it, this does nothing.
import * as fs from 'node:fs';
import { register } from 'node:module';

if (typeof fs.globSync !== 'function') {
  register('./hooks.mjs', import.meta.url);
}
