#!/usr/bin/env bash
# The package as users get it: `npm pack` of the built dist/ (run `tsup` first), installed into a
# fresh project outside the repository with only the peers the bot uses, then
#   - the bot of scripts/.pack-fixture/ and every entry of the export map type-checked by tsc
#     (nodenext, strict, no skipLibCheck),
#   - run on Node and on Bun (memory, SQLite, and Postgres when reachable; required under
#     BOTMESH_REQUIRE_SERVICES=1), each reply sent exactly once,
#   - bundled with esbuild for Node (the optional drivers and clients stay unresolved without
#     failing the build) and run again,
#   - the botmesh-durable bin.
# Installs prefer npm's cache (--prefer-offline); better-sqlite3 is linked from the repository's
# node_modules instead of being compiled again. The fixture's folder starts with a dot so that the
# repository's own tsc (which cannot resolve the package by its name) leaves it out.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
export PATH="$repo/node_modules/.bin:$PATH"

fail() { echo "pack smoke: $*" >&2; exit 1; }
[ -f dist/mod.js ] && [ -f dist/cli.js ] || fail "dist/ is not built (run tsup first)"

work=$(mktemp -d "${TMPDIR:-/tmp}/botmesh-pack-smoke-XXXXXX")
trap 'rm -rf "$work"' EXIT

# The tarball, from the dist/ already built (prepack would build it again).
npm pack --ignore-scripts --silent --pack-destination "$work" >/dev/null
tarball=$(ls "$work"/*.tgz)
listing=$(tar -tzf "$tarball")
for f in package/package.json package/README.md package/LICENSE package/dist/mod.js package/dist/mod.d.ts \
  package/dist/cli.js package/dist/cli.d.ts package/dist/backends/sqlite/mod.d.ts package/dist/testing.js; do
  grep -qx "$f" <<<"$listing" || fail "the tarball has no $f"
done
if grep -v '^package/\(dist/\|docs/[a-z-]*\.md$\|docs/es/[A-Za-z-]*\.md$\|docs/grafana/[a-z-]*\.\(json\|png\)$\|package\.json$\|README\.md$\|LICENSE$\)' <<<"$listing"; then
  fail "the tarball holds files outside dist/ and docs/ (listed above)"
fi
echo "pack smoke: $(basename "$tarball"), $(wc -l <<<"$listing") files (${SECONDS} s)"

# A fresh project: the tarball, the peer the bot uses, and the type checker at the repository's versions.
app="$work/app"
mkdir -p "$app"
cp scripts/.pack-fixture/package.json scripts/.pack-fixture/tsconfig.json scripts/.pack-fixture/bot.ts "$app/"
version_of() { node -p "require('$repo/node_modules/$1/package.json').version"; }
(
  cd "$app"
  npm install --prefer-offline --no-audit --no-fund --loglevel=error \
    "$tarball" "postgres@$(version_of postgres)" "typescript@$(version_of typescript)" "@types/node@$(version_of @types/node)"
)
echo "pack smoke: installed (${SECONDS} s)"
# Node 20 has no node:sqlite: the optional peer better-sqlite3, already built in the repository.
ln -s "$repo/node_modules/better-sqlite3" "$app/node_modules/better-sqlite3"

cd "$app"
# Every entry of the export map in the program, so that tsc checks all the published declarations; but
# ./builderbot, whose declarations extend BuilderBot's ProviderClass: @builderbot/bot's own declarations
# do not resolve under nodenext (extensionless relative imports), so it is checked below as its users
# compile it (bundler resolution, skipLibCheck), with @builderbot/bot linked from the repository.
node -e '
  const pkg = require("./node_modules/@botmesh/durable/package.json");
  const lines = Object.keys(pkg.exports).filter((key) => key !== "./builderbot").map((key, i) => `import type * as entry${i} from "${pkg.name}${key.slice(1)}";`);
  lines.push(`export type Entries = [${lines.map((_, i) => `typeof entry${i}`).join(", ")}];`);
  require("fs").writeFileSync("entries.ts", lines.join("\n") + "\n");
'
echo "pack smoke: tsc (nodenext, strict, no skipLibCheck)"
node_modules/.bin/tsc -p tsconfig.json
mkdir -p node_modules/@builderbot
ln -s "$repo/node_modules/@builderbot/bot" node_modules/@builderbot/bot
cat > builderbot.ts <<'TS'
import { createBot, createFlow, addKeyword } from "@builderbot/bot";
import { MemoryDurability, MemoryStore } from "@botmesh/durable";
import { DurableMetaProvider } from "@botmesh/durable/builderbot";
const provider = new DurableMetaProvider({
  whatsapp: { accessToken: "t", phoneNumberId: "1", appSecret: "s", verifyToken: "v" },
  durability: { backend: new MemoryDurability(), instanceId: "pack" },
  store: new MemoryStore(),
});
const bot = await createBot({ flow: createFlow([addKeyword("hola").addAnswer("hi")]), provider, database: provider.database });
provider.attach(bot);
TS
cat > tsconfig.builderbot.json <<'JSON'
{
  "compilerOptions": {
    "target": "es2022", "module": "esnext", "moduleResolution": "bundler", "strict": true,
    "skipLibCheck": true, "types": ["node"], "noEmit": true
  },
  "files": ["builderbot.ts"]
}
JSON
node_modules/.bin/tsc -p tsconfig.builderbot.json
echo "pack smoke: type-checked (${SECONDS} s)"
node out/bot.js
"$repo/node_modules/.bin/bun" out/bot.js
# An app bundler must not need the peers the app does not use (bun:sqlite, ioredis, @upstash/redis).
"$repo/node_modules/.bin/esbuild" out/bot.js --bundle --platform=node --format=esm --log-level=error \
  --outfile=out/bundled.mjs || fail "esbuild could not bundle the bot"
node out/bundled.mjs
version=$(node_modules/.bin/botmesh-durable --version)
[ "$version" = "botmesh-durable $(node -p "require('$repo/package.json').version")" ] || fail "botmesh-durable --version printed ${version@Q}"
echo "pack smoke: $version; ok (${SECONDS} s)"
