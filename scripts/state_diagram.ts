// The state diagrams of docs/architecture.md, generated from the state table (src/machine.ts).
// `bun scripts/state_diagram.ts` prints them; `--write` puts them into the doc between their markers.
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { INBOX_MACHINE, type Machine, mermaidDiagram, OUTBOX_MACHINE } from "../src/machine.ts";

const MACHINES: readonly Machine<string, string>[] = [INBOX_MACHINE, OUTBOX_MACHINE];

export const DOC: string = join(import.meta.dir, "..", "docs", "architecture.md");

/** The doc's text with each `<!-- state-diagram:inbox -->` … `<!-- /state-diagram -->` block as the table draws it. */
export function withDiagrams(doc: string): string {
  let out = doc;
  for (const machine of MACHINES) {
    const open = `<!-- state-diagram:${machine.journal} -->`;
    const start = out.indexOf(open);
    const end = out.indexOf("<!-- /state-diagram -->", start);
    if (start < 0 || end < 0) throw new Error(`docs/architecture.md has no ${open} … <!-- /state-diagram --> block`);
    out = `${out.slice(0, start)}${open}\n\`\`\`mermaid\n${mermaidDiagram(machine)}\n\`\`\`\n${out.slice(end)}`;
  }
  return out;
}

if (import.meta.main) {
  if (process.argv.includes("--write")) {
    writeFileSync(DOC, withDiagrams(readFileSync(DOC, "utf8")));
  } else {
    for (const machine of MACHINES) console.log(`${machine.journal}:\n${mermaidDiagram(machine)}\n`);
  }
}
