export { RequestStateClient, StatesealError } from './client.js';
export type { Binding, ClientOptions, Lease, Opened, Sealed } from './client.js';
export { StatesealBoundary, defaultPrincipal, install } from './boundary.js';
export type { BoundaryOptions, Logger } from './boundary.js';
export {
  BINDING_VERSION,
  BindingError,
  asciiJson,
  canonicalNumber,
  canonicalize,
  paramsDigest,
  paramsDigestOf,
  subjectFor,
} from './binding.js';
export type { BindableMethod } from './binding.js';
