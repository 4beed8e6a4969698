// Build step: copy the service's proto into the package and generate its
// TypeScript types (pure JS: @grpc/proto-loader, no protoc). Nothing
// generated is committed, so nothing can go stale.
import { cpSync, rmSync, mkdirSync } from 'node:fs';
import { execFileSync } from 'node:child_process';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
rmSync(join(root, 'proto'), { recursive: true, force: true });
cpSync(join(root, '..', '..', 'proto'), join(root, 'proto'), { recursive: true });
rmSync(join(root, 'src', '_proto'), { recursive: true, force: true });
mkdirSync(join(root, 'src', '_proto'), { recursive: true });
execFileSync(
  process.execPath,
  [
    join(root, 'node_modules', '@grpc', 'proto-loader', 'build', 'bin', 'proto-loader-gen-types.js'),
    'stateseal/v1/stateseal.proto',
    '--grpcLib=@grpc/grpc-js',
    '--keepCase',
    '--longs=Number',
    '--enums=String',
    '--defaults',
    '--oneofs',
    '--importFileExtension=.js',
    `--outDir=${join(root, 'src', '_proto')}`,
    `--includeDirs=${join(root, 'proto')}`,
  ],
  { stdio: 'inherit' },
);
