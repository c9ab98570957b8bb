import { defineConfig } from "tsup";

export default defineConfig({
  entry: { mod: "mod.ts", testing: "testing.ts" },
  outDir: "dist",
  format: ["esm"],
  target: "node20",
  dts: true,
  clean: true,
  splitting: true,
  sourcemap: true,
});
