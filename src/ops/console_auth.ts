/**
 * Authentication of the operations console: HTTP Basic for one operator
 * account ({@link basicAuth}) and the CSRF tokens bound into every
 * confirmation form. Web Crypto only.
 *
 * @module
 */

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

/** Options of {@link basicAuth}. */
export interface BasicAuthOptions {
  /** The realm shown by the browser (default `"Durability console"`). */
  realm?: string;
}

/**
 * HTTP Basic authentication for one operator account, for {@link durabilityConsole}'s
 * `auth`. Credentials are compared in constant time (SHA-256 digests of both
 * sides); a refused request gets `WWW-Authenticate: Basic realm="…", charset="UTF-8"`.
 * Use it only over HTTPS (or on localhost): Basic credentials are not encrypted.
 *
 * @param user the expected user name (non-empty, no `:`)
 * @param password the expected password (non-empty)
 * @param options `realm`
 * @returns an auth function whose identity is `{ user }`
 * @throws {TypeError} when `user` or `password` is not a non-empty string, or `user` contains `:`
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
    return userOk && passwordOk ? { user } : null;
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
