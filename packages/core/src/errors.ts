import { ERROR_CODES, type ErrorCode, isErrorCode } from "./error-codes.js";

// Brands live in the global symbol registry so `instanceof` holds across two copies of this
// package (a bundled dependency next to the workspace one, CJS next to ESM).
const KINDS = Symbol.for("moeswarm.error.kinds");

export interface MoeswarmErrorOptions {
  cause?: unknown;
  /** Context a caller can act on (layer, worker id, byte offset...); serialisable values only. */
  details?: Readonly<Record<string, unknown>>;
}

function hasKind(value: unknown, kind: string): boolean {
  if (typeof value !== "object" || value === null) return false;
  const kinds = (value as { [KINDS]?: unknown })[KINDS];
  return Array.isArray(kinds) && kinds.includes(kind);
}

/** The base of every error moeswarm throws: a stable `code`, a message, an optional `cause`. */
export class MoeswarmError extends Error {
  readonly code: ErrorCode;
  readonly details: Readonly<Record<string, unknown>> | undefined;
  declare readonly [KINDS]: readonly string[];

  constructor(code: ErrorCode, message?: string, options: MoeswarmErrorOptions = {}) {
    super(
      message ?? ERROR_CODES[code].text,
      options.cause === undefined ? undefined : { cause: options.cause },
    );
    this.code = code;
    this.details = options.details;
    const kinds: string[] = [];
    for (
      let p: object | null = new.target.prototype;
      p && p !== Error.prototype;
      p = Object.getPrototypeOf(p)
    ) {
      const ctor = (p as { constructor?: { kind?: string } }).constructor;
      if (ctor?.kind) kinds.push(ctor.kind);
    }
    Object.defineProperty(this, KINDS, { value: Object.freeze(kinds), enumerable: false });
    Object.defineProperty(this, "name", { value: new.target.name, enumerable: false, configurable: true });
  }

  /** The name checked by the cross-copy `instanceof`; subclasses override it. */
  static readonly kind: string = "MoeswarmError";

  static override [Symbol.hasInstance](value: unknown): boolean {
    return hasKind(value, this.kind);
  }

  /** A plain object for logs and for `error` frames. */
  toJSON(): { name: string; code: ErrorCode; message: string; details?: Readonly<Record<string, unknown>> } {
    return this.details === undefined
      ? { name: this.name, code: this.code, message: this.message }
      : { name: this.name, code: this.code, message: this.message, details: this.details };
  }
}

type Area = (typeof ERROR_CODES)[ErrorCode]["area"];
/** Codes whose table entry names the given area: a subclass accepts only its own codes. */
export type CodeOf<A extends Area> = {
  [C in ErrorCode]: (typeof ERROR_CODES)[C]["area"] extends A ? C : never;
}[ErrorCode];

type AreaErrorClass<A extends Area> = {
  new (
    code: CodeOf<A>,
    message?: string,
    options?: MoeswarmErrorOptions,
  ): MoeswarmError & { readonly code: CodeOf<A> };
  readonly kind: A;
};

/** An area class that also takes just a message, for its most common code. */
type DefaultedErrorClass<A extends Area> = AreaErrorClass<A> & {
  new (message: string, options?: MoeswarmErrorOptions): MoeswarmError & { readonly code: CodeOf<A> };
  readonly defaultCode: CodeOf<A>;
};

// Every area's class by its name, for turning a code back into its class (errorFromCode).
const AREA_CLASSES = new Map<Area, AreaErrorClass<Area>>();

function isCodeOf(value: unknown, kind: Area): boolean {
  return typeof value === "string" && isErrorCode(value) && ERROR_CODES[value].area === kind;
}

// One factory instead of nine copies of the same class body. With a default code the class also
// accepts `new InvalidArgumentError(message, options?)`: a first argument that is not one of the
// area's codes is the message.
function defineArea<A extends Area>(kind: A): AreaErrorClass<A>;
function defineArea<A extends Area>(kind: A, defaultCode: CodeOf<A>): DefaultedErrorClass<A>;
function defineArea<A extends Area>(kind: A, defaultCode?: CodeOf<A>): AreaErrorClass<A> {
  const cls = class extends MoeswarmError {
    static override readonly kind: string = kind;
    static readonly defaultCode = defaultCode;
    constructor(
      codeOrMessage: string,
      messageOrOptions?: string | MoeswarmErrorOptions,
      options?: MoeswarmErrorOptions,
    ) {
      if (isCodeOf(codeOrMessage, kind)) {
        super(codeOrMessage as ErrorCode, messageOrOptions as string | undefined, options);
        return;
      }
      if (isErrorCode(codeOrMessage)) {
        throw new TypeError(
          `error code ${codeOrMessage} belongs to ${ERROR_CODES[codeOrMessage].area}, not ${kind}`,
        );
      }
      if (defaultCode === undefined) {
        throw new TypeError(`${kind} needs an explicit code (got ${JSON.stringify(codeOrMessage)})`);
      }
      super(defaultCode, codeOrMessage, messageOrOptions as MoeswarmErrorOptions | undefined);
    }
  };
  Object.defineProperty(cls, "name", { value: kind });
  AREA_CLASSES.set(kind, cls as unknown as AreaErrorClass<Area>);
  return cls as unknown as AreaErrorClass<A>;
}

export const InvalidArgumentError = defineArea("InvalidArgumentError", "MOESWARM_INVALID_ARGUMENT");
export type InvalidArgumentError = InstanceType<typeof InvalidArgumentError>;
export const AbortError = defineArea("AbortError", "MOESWARM_ABORTED");
export type AbortError = InstanceType<typeof AbortError>;
export const GgufError = defineArea("GgufError");
export type GgufError = InstanceType<typeof GgufError>;
export const ProtocolError = defineArea("ProtocolError", "MOESWARM_PROTOCOL_MALFORMED");
export type ProtocolError = InstanceType<typeof ProtocolError>;
export const DispatchError = defineArea("DispatchError", "MOESWARM_DISPATCH_FAILED");
export type DispatchError = InstanceType<typeof DispatchError>;
export const TransportError = defineArea("TransportError");
export type TransportError = InstanceType<typeof TransportError>;
export const AuthError = defineArea("AuthError", "MOESWARM_AUTH_INVALID");
export type AuthError = InstanceType<typeof AuthError>;
export const NativeError = defineArea("NativeError");
export type NativeError = InstanceType<typeof NativeError>;
export const HubError = defineArea("HubError");
export type HubError = InstanceType<typeof HubError>;
export const IoError = defineArea("IoError", "MOESWARM_IO_FAILED");
export type IoError = InstanceType<typeof IoError>;

// Node's system error codes by the code that says what happened locally
const SYSTEM_CODES: Readonly<Record<string, CodeOf<"IoError">>> = {
  ENOSPC: "MOESWARM_IO_NO_SPACE",
  EDQUOT: "MOESWARM_IO_NO_SPACE",
  EACCES: "MOESWARM_IO_ACCESS",
  EPERM: "MOESWARM_IO_ACCESS",
  EROFS: "MOESWARM_IO_ACCESS",
  ENOENT: "MOESWARM_IO_NOT_FOUND",
  ENOTDIR: "MOESWARM_IO_NOT_FOUND",
  EISDIR: "MOESWARM_IO_NOT_FOUND",
  EMFILE: "MOESWARM_IO_TOO_MANY_FILES",
  ENFILE: "MOESWARM_IO_TOO_MANY_FILES",
};

/**
 * A local file system failure as an IoError with the code that says what happened (a full disk
 * is MOESWARM_IO_NO_SPACE, not a network error), `context` first in its message ("writing the
 * slice to /data/x.gguf"), the system error as its cause and its `code`, `syscall` and `path` in
 * `details`. A moeswarm error is returned as it is; anything else is MOESWARM_IO_FAILED.
 */
export function errorFromSystemError(error: unknown, context: string): MoeswarmError {
  if (isMoeswarmError(error)) return error;
  const e = error as { code?: unknown; syscall?: unknown; path?: unknown; message?: unknown } | null;
  const system = typeof e?.code === "string" ? e.code : undefined;
  const details: Record<string, unknown> = {};
  if (system !== undefined) details.code = system;
  if (typeof e?.syscall === "string") details.syscall = e.syscall;
  if (typeof e?.path === "string") details.path = e.path;
  const message = typeof e?.message === "string" ? e.message : String(error);
  return new IoError(
    (system !== undefined && SYSTEM_CODES[system]) || "MOESWARM_IO_FAILED",
    `${context}: ${message}`,
    { cause: error, details },
  );
}

export interface ErrorFromCodeOptions extends MoeswarmErrorOptions {
  /**
   * What a code this build does not know (one from a newer peer) becomes, with the original code
   * kept in `details.code` (default MOESWARM_DISPATCH_FAILED, a DispatchError).
   */
  fallback?: ErrorCode;
}

/**
 * The typed error for a `MOESWARM_*` code that crossed a process or language boundary (an `error`
 * frame, a hub's JSON error, a native addon's rejection): an instance of the class that owns the
 * code, so that `instanceof AuthError` works on the receiving side.
 */
export function errorFromCode(
  code: string,
  message: string,
  options: ErrorFromCodeOptions = {},
): MoeswarmError {
  const { fallback = "MOESWARM_DISPATCH_FAILED", ...rest } = options;
  if (isErrorCode(code)) return new (classOf(code))(code as never, message, rest);
  return new (classOf(fallback))(fallback as never, `${code}: ${message}`, {
    ...rest,
    details: { ...rest.details, code },
  });
}

function classOf(code: ErrorCode): AreaErrorClass<Area> {
  // defineArea registered every area (errors.test.ts turns every code of the table into its class)
  return AREA_CLASSES.get(ERROR_CODES[code].area)!;
}

/** Longest `msg` errorToWire writes: well under the protocol's 16 KiB, whatever the characters. */
const WIRE_MESSAGE_CHARS = 4096;

/**
 * The code and message an `error` frame carries for any thrown value: a moeswarm error's own,
 * anything else as MOESWARM_DISPATCH_FAILED.
 */
export function errorToWire(error: unknown): { code: ErrorCode; msg: string } {
  if (isMoeswarmError(error)) return { code: error.code, msg: error.message.slice(0, WIRE_MESSAGE_CHARS) };
  const msg = error instanceof Error ? error.message : String(error);
  return { code: "MOESWARM_DISPATCH_FAILED", msg: msg.slice(0, WIRE_MESSAGE_CHARS) };
}

/** True for any moeswarm error, from any copy of the package; optionally with the given code. */
export function isMoeswarmError(value: unknown, code?: ErrorCode): value is MoeswarmError {
  return hasKind(value, "MoeswarmError") && (code === undefined || (value as MoeswarmError).code === code);
}

/**
 * Throws the signal's reason if it is aborted. The reason is used as is when it is already an
 * Error (callers expect `signal.reason`), else wrapped in an AbortError.
 */
export function throwIfAborted(signal: AbortSignal | undefined): void {
  if (signal?.aborted) throw abortReason(signal);
}

/** The error to reject with when `signal` aborts. */
export function abortReason(signal: AbortSignal): unknown {
  const reason: unknown = signal.reason;
  return reason instanceof Error ? reason : new AbortError("MOESWARM_ABORTED", undefined, { cause: reason });
}
