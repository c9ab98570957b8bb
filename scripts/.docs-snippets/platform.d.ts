// The platform globals the docs' snippets use, for scripts/docs-snippets.ts: the few members of
// Deno's, Cloudflare Workers' and Vercel's own types that the snippets call (their packages are not
// dependencies of this repository). Nothing of @botmesh/durable is declared here.
declare namespace Deno {
  function serve(handler: (request: Request) => Response | Promise<Response>): unknown;
  function serve(
    options: { port?: number; hostname?: string; onListen?: (addr: { port: number }) => void },
    handler: (request: Request) => Response | Promise<Response>,
  ): unknown;
  const env: { get(name: string): string | undefined };
  const cron: ((name: string, schedule: string, handler: () => Promise<void> | void) => Promise<void>) | undefined;
}
interface ExecutionContext {
  waitUntil(promise: Promise<unknown>): void;
}
interface ScheduledController {
  readonly scheduledTime: number;
  readonly cron: string;
}
declare module "@vercel/functions" {
  export function waitUntil(promise: Promise<unknown>): void;
}
