/**
 * Backend URLs as messages show them: passwords, tokens and secret query
 * parameters replaced by `***`.
 *
 * @module
 */

/** Schemes of a local file: what follows is a path, never credentials. */
const LOCAL = new Set(["sqlite", "file", "events+file", "events+shared"]);
/** Schemes whose userinfo is `user[:password]`, as their drivers read it (any other: a token, hidden whole). */
const USER_PASSWORD = new Set(["postgres", "postgresql", "redis", "rediss"]);
/** Of those, the ones whose userinfo without `:` is only a user name (Redis clients have read it as a password). */
const USER_ONLY = new Set(["postgres", "postgresql"]);

/** A scheme where a URL may start: not inside a word, followed by something. */
const SCHEME = /(?<![a-z0-9+.-])([a-z][a-z0-9+.-]+):(?=\S)\/*/gi;
/**
 * A query parameter named like a secret (`password`, `sslpassword`, `token`, `apiKey`; not `keyPrefix`) and its
 * value, which ends at `&`, `#`, a space or a `"` that closes a quoted URL.
 */
const SECRET_PARAM = /([?&;](?:[^=&;#?\s"]*(?:pass|pwd|token|secret|auth)[^=&;#?\s"]*|[^=&;#?\s"]*key)=)(?:[^&#\s"]|"(?![\s),;:]|$))*/gi;

/**
 * `text` (a backend URL, or a message quoting one) without its secrets.
 *
 * The userinfo runs from the scheme (after `//`, `/` or nothing) to the LAST
 * `@` of the whole text, not of the authority: a generated password with an
 * unencoded `/`, `?`, `#` or `@` is hidden whole, and the drivers read the
 * userinfo up to the authority's last `@`, so nothing they take as a password
 * is shown. An `@` in a path or query is hidden with it (more hidden, never
 * less). The user name before the first `:` stays for Postgres and Redis
 * (`postgres://app:***@db:5432/x`); a Postgres userinfo without `:` is a user
 * name and stays; any other userinfo (an Upstash token, a Redis password
 * written without its `:`, an unknown scheme's) is hidden whole. The value of
 * a query parameter named like a secret is hidden too
 * (`redis://host/?password=***`). A URL anywhere in the text is found, so
 * this also serves for a command line's messages quoting its arguments;
 * `sqlite:`, `file:` and `events+…:` paths are left alone.
 * @param text the URL as given, or a message
 * @returns the text to show
 */
export function hideCredentials(text: string): string {
  return hideUserinfo(text).replace(SECRET_PARAM, "$1***");
}

function hideUserinfo(text: string): string {
  const at = text.lastIndexOf("@");
  if (at === -1) return text;
  for (const m of text.matchAll(SCHEME)) {
    const start = m.index + m[0].length;
    if (start > at) break;
    const scheme = m[1]!.toLowerCase();
    if (LOCAL.has(scheme)) continue;
    const userinfo = text.slice(start, at);
    const colon = userinfo.indexOf(":");
    const shown = !USER_PASSWORD.has(scheme)
      ? "***"
      : colon !== -1
      ? `${userinfo.slice(0, colon)}:***`
      : USER_ONLY.has(scheme)
      ? userinfo
      : "***";
    return `${text.slice(0, start)}${shown}${text.slice(at)}`;
  }
  return text;
}
