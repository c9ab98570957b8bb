/**
 * The client address of each request a server of this process received:
 * `serveHttp` and `nodeHandler` record it, and the console's sign-in limit
 * counts failed attempts by it. Kept apart from the servers, so that a
 * module that only reads it loads no server code.
 *
 * @module
 */

/** The client address of each request a server of this process received (the console's sign-in limit counts by it). */
const remoteAddresses = new WeakMap<Request, string>();

/**
 * Records the client address a request came from (the servers here, and `nodeHandler`, do it).
 * @param request the request
 * @param address the peer's IP address, if the server knows it
 */
export function noteRemoteAddress(request: Request, address: string | undefined | null): void {
  if (typeof address === "string" && address !== "") remoteAddresses.set(request, address);
}

/**
 * The client address a request came from, when a server of this process recorded it.
 * @param request a request handed to a handler by `serveHttp` or `nodeHandler`
 * @returns the peer's IP address, or `undefined`
 */
export function remoteAddressOf(request: Request): string | undefined {
  return remoteAddresses.get(request);
}
