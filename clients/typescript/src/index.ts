export { MAX_CARRIED_COMMITS, RequestStateClient, StatesealError } from './client.js';
export type { Binding, ClientOptions, Lease, Opened, Sealed } from './client.js';
export { Status } from './transport.js';
export type { TlsOptions } from './transport.js';
export {
  DEFAULT_COMMIT_DELAY_MS,
  DEFAULT_COMMIT_WINDOW_MS,
  DEFAULT_MAX_INPUT_RESPONSES_BYTES,
  DEFAULT_MAX_PENDING_COMMITS,
  DEFAULT_MAX_REQUEST_STATE_BYTES,
  StatesealBoundary,
  callRefusal,
  defaultPrincipal,
  install,
  openRefusal,
  renewalLost,
  resend,
  retryCommit,
} from './boundary.js';
export type { BoundaryOptions, Logger, Refusal } from './boundary.js';
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
