/**
 * A backend URL as messages show it: the password (or an Upstash token)
 * replaced by `***`.
 *
 * @module
 */

/**
 * `url` without its secret: the userinfo is everything before the last `@`
 * of the authority (which ends at the first `/`, `?` or `#`), as the drivers
 * parse it, so a password with an `@` in it is hidden whole. The user name
 * stays (`postgres://app:***@db:5432/x`); an Upstash URL's userinfo is its
 * token (`redis+upstash://***@host`). An `@` in the path or query is left alone.
 * @param url the URL as given
 * @returns the URL to show
 */
export function hideCredentials(url: string): string {
  const m = /^([a-z][a-z0-9+.-]*:\/\/)([^/?#]*)/i.exec(url);
  if (m === null) return url;
  const scheme = m[1]!;
  const authority = m[2]!;
  const at = authority.lastIndexOf("@");
  if (at === -1) return url;
  const userinfo = authority.slice(0, at);
  const rest = url.slice(scheme.length + at);
  if (scheme.toLowerCase().startsWith("redis+upstash")) return `${scheme}***${rest}`;
  const colon = userinfo.indexOf(":");
  return colon === -1 ? url : `${scheme}${userinfo.slice(0, colon)}:***${rest}`;
}
