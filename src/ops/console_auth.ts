/**
 * Authentication of the operations console: HTTP Basic for one operator
 * account ({@link basicAuth}) and the CSRF tokens bound into every
 * confirmation form. Web Crypto only.
 *
 * @module
 */
import { BoundedMap } from "../bounded_map.ts";
import { checkClock, type Clock, systemClock } from "../clock.ts";
import { integerOption } from "./console_render.ts";

/** Who is using the console, as established by {@link ConsoleAuth}. */
export interface ConsoleIdentity {
  /** The operator's name (shown in the page, bound into every CSRF token). */
  user: string;
}

/**
 * Authenticates a console request: the identity, or `null` to refuse it (401).
 * When the function has a `challenge` property (as {@link basicAuth}'s does),
 * a refused request gets it as its `WWW-Authenticate` header.
 */
export type ConsoleAuth =
  & ((request: Request) => Promise<ConsoleIdentity | null> | ConsoleIdentity | null)
  & { readonly challenge?: string };


// ---------------------------------------------------------------------------
// Crypto helpers (Web Crypto only)

/** UTF-8 encoding, shared by the console's modules. */
export const encoder: TextEncoder = new TextEncoder();

function base64url(bytes: Uint8Array): string {
  let binary = "";
  for (const b of bytes) binary += String.fromCharCode(b);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** Compare two byte strings in constant time (lengths are public: digests and tokens have fixed sizes). */
function constantTimeEqual(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a[i]! ^ b[i]!;
  return diff === 0;
}

async function sha256(text: string): Promise<Uint8Array> {
  return new Uint8Array(await crypto.subtle.digest("SHA-256", encoder.encode(text)));
}

// ---------------------------------------------------------------------------
// Basic auth

/**
 * Thrown by {@link basicAuth}'s function while a client may not try to sign in
 * (too many failed attempts): the console answers 429 with `Retry-After`.
 */
export class SignInLimitedError extends Error {
  /** How long until the client may try again, in ms. */
  readonly retryAfterMs: number;
  /**
   * @param retryAfterMs how long until the client may try again, in ms
   */
  constructor(retryAfterMs: number) {
    super(`Too many failed sign-ins: try again in ${Math.ceil(retryAfterMs / 1000)} s`);
    this.name = "SignInLimitedError";
    this.retryAfterMs = retryAfterMs;
  }
}

/** The most clients whose failed sign-ins are counted at once (the oldest are forgotten past it). */
const MAX_SIGN_IN_CLIENTS = 10_000;

/** Options of {@link basicAuth}. */
export interface BasicAuthOptions {
  /** The realm shown by the browser (default `"Durability console"`). */
  realm?: string;
  /**
   * Failed sign-ins a client may make within `failureWindowMs` (default 10, 1…1000); past them
   * every attempt, right or wrong, is refused (429) until the window ends. A sign-in that succeeds
   * clears the client's count.
   */
  maxFailures?: number;
  /** The window of `maxFailures`, from a client's first failure, in ms (default 15 minutes, 1 s…24 h). */
  failureWindowMs?: number;
  /**
   * Which client a request comes from, e.g. the remote address your server reports. Default (or
   * when it gives `null`): the user name tried, the right one or any other (so the operator's
   * account is held back while someone guesses its password).
   */
  clientKey?: (request: Request) => string | null | undefined;
  /** The clock of the window (default the system's). */
  clock?: Clock;
}

/**
 * HTTP Basic authentication for one operator account, for {@link durabilityConsole}'s
 * `auth`. Credentials are compared in constant time (SHA-256 digests of both
 * sides); a refused request gets `WWW-Authenticate: Basic realm="…", charset="UTF-8"`.
 * After `maxFailures` failed sign-ins of one client (by default: of the user name
 * tried) within `failureWindowMs`, its attempts are refused with 429 and `Retry-After`
 * until the window ends ({@link SignInLimitedError}).
 * Use it only over HTTPS (or on localhost): Basic credentials are not encrypted.
 *
 * @param user the expected user name (non-empty, no `:`)
 * @param password the expected password (non-empty)
 * @param options `realm`, `maxFailures`, `failureWindowMs`, `clientKey`, `clock`
 * @returns an auth function whose identity is `{ user }`
 * @throws {TypeError} when `user` or `password` is not a non-empty string, or `user` contains `:`, or an option has the wrong type
 * @throws {RangeError} when `maxFailures` or `failureWindowMs` is out of range
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * const bot = new Bot({ provider: new MockProvider(), durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * import { basicAuth, durabilityConsole } from "@botmesh/durable/ops";
 * const handler = durabilityConsole(bot, { auth: basicAuth("ops", "a-long-password-from-your-vault") });
 * ```
 */
export function basicAuth(user: string, password: string, options: BasicAuthOptions = {}): ConsoleAuth {
  if (typeof user !== "string" || user === "" || user.includes(":")) {
    throw new TypeError(`Argument "user" must be a non-empty string without ":", got ${JSON.stringify(user) ?? typeof user}`);
  }
  if (typeof password !== "string" || password === "") {
    throw new TypeError(`Argument "password" must be a non-empty string`);
  }
  const realm = options.realm ?? "Durability console";
  if (typeof realm !== "string" || /["\\\r\n]/.test(realm)) {
    throw new TypeError(`Option "realm" must be a string without quotes, backslashes or line breaks`);
  }
  const maxFailures = integerOption(options.maxFailures, "maxFailures", 10, 1, 1000);
  const failureWindowMs = integerOption(options.failureWindowMs, "failureWindowMs", 900_000, 1000, 86_400_000);
  const clientKey = options.clientKey;
  if (clientKey !== undefined && typeof clientKey !== "function") {
    throw new TypeError(`Option "clientKey" must be a function (request) => string | null, got ${typeof clientKey}`);
  }
  const clock = options.clock === undefined ? systemClock : checkClock(options.clock, "clock");
  /** Failed sign-ins per client: how many, since when. */
  const failures = new BoundedMap<string, { count: number; since: number }>(MAX_SIGN_IN_CLIENTS);
  const expected = Promise.all([sha256(`u:${user}`), sha256(`p:${password}`)]);
  const check = async (request: Request): Promise<ConsoleIdentity | null> => {
    const header = request.headers.get("authorization");
    const match = header ? /^Basic[ ]+([A-Za-z0-9+/]+={0,2})[ ]*$/i.exec(header) : null;
    if (!match) return null;
    let decoded: string;
    try {
      const binary = atob(match[1]!);
      decoded = new TextDecoder("utf-8", { fatal: true }).decode(Uint8Array.from(binary, (c) => c.charCodeAt(0)));
    } catch {
      return null;
    }
    const colon = decoded.indexOf(":");
    if (colon < 0) return null;
    const [wantUser, wantPassword] = await expected;
    const [gotUser, gotPassword] = await Promise.all([
      sha256(`u:${decoded.slice(0, colon)}`),
      sha256(`p:${decoded.slice(colon + 1)}`),
    ]);
    // Both comparisons always run (no short circuit).
    const userOk = constantTimeEqual(wantUser, gotUser);
    const passwordOk = constantTimeEqual(wantPassword, gotPassword);
    // Every wrong user name counts under one key: guesses with it cannot succeed, and they must not push
    // the operator's count out of the map.
    const key = clientKey?.(request) ?? (userOk ? "user:" : "other users:");
    const now = clock.now();
    let failed = failures.get(key);
    if (failed !== undefined && now - failed.since >= failureWindowMs) {
      failures.delete(key);
      failed = undefined;
    }
    if (failed !== undefined && failed.count >= maxFailures) throw new SignInLimitedError(failed.since + failureWindowMs - now);
    if (userOk && passwordOk) {
      failures.delete(key);
      return { user };
    }
    if (failed === undefined) failures.set(key, { count: 1, since: now });
    else failed.count++;
    return null;
  };
  return Object.assign(check, { challenge: `Basic realm="${realm}", charset="UTF-8"` });
}

// ---------------------------------------------------------------------------
// CSRF tokens

/**
 * CSRF tokens of the confirmation forms: `<issuedAt>.<HMAC-SHA256>` over the
 * user, the action and what it acts on (a record id, or a bulk action's
 * filter and count), valid for `maxAgeMs`.
 */
export class CsrfTokens {
  #key: Promise<CryptoKey>;
  #maxAgeMs: number;

  /**
   * @param secret the HMAC key (at least 16 bytes, checked by the caller)
   * @param maxAgeMs how long a token stays valid
   */
  constructor(secret: Uint8Array<ArrayBuffer>, maxAgeMs: number) {
    this.#key = crypto.subtle.importKey("raw", secret, { name: "HMAC", hash: "SHA-256" }, false, ["sign", "verify"]);
    this.#maxAgeMs = maxAgeMs;
  }

  async #mac(user: string, action: string, id: string, issuedAt: number): Promise<Uint8Array> {
    const message = encoder.encode(JSON.stringify(["botmesh-console-csrf-v1", user, action, id, issuedAt]));
    return new Uint8Array(await crypto.subtle.sign("HMAC", await this.#key, message));
  }

  /**
   * A token for `user` to do `action` on `id`.
   * @param user the operator
   * @param action the action's path
   * @param id what it acts on
   * @returns the token
   */
  async issue(user: string, action: string, id: string): Promise<string> {
    const issuedAt = Date.now();
    return `${issuedAt}.${base64url(await this.#mac(user, action, id, issuedAt))}`;
  }

  /**
   * Check a posted token.
   * @param token the form's `csrf` field
   * @param user the operator posting it
   * @param action the action's path
   * @param id what it acts on
   * @returns `null` when valid, else why not
   */
  async check(token: string | null, user: string, action: string, id: string): Promise<string | null> {
    if (!token) return "the CSRF token is missing";
    const match = /^(\d{1,16})\.([A-Za-z0-9_-]{43})$/.exec(token);
    if (!match) return "the CSRF token is malformed";
    const issuedAt = Number(match[1]);
    const now = Date.now();
    const expected = base64url(await this.#mac(user, action, id, issuedAt));
    if (!constantTimeEqual(encoder.encode(expected), encoder.encode(match[2]!))) return "the CSRF token is not valid";
    if (issuedAt > now + 60_000 || now - issuedAt > this.#maxAgeMs) {
      return "the confirmation page has expired: open it again";
    }
    return null;
  }
}
