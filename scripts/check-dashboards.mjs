#!/usr/bin/env node
// Validates Grafana dashboards against Grafana's own schema: the TypeScript type `Dashboard` of
// npm @grafana/schema (dist/types/raw/dashboard/x/types.gen.d.ts), turned into a JSON Schema
// by ts-json-schema-generator and checked with ajv. Writes every query the dashboards hold
// (panels, annotations) to OUT as JSON lines {dashboard, panel, expr}, for promtool and the
// metric-name check in scripts/check-monitoring.sh.
//
// usage: node scripts/check-dashboards.mjs NPM_DIR OUT DASHBOARD.json...
//   NPM_DIR: where @grafana/schema, ts-json-schema-generator and ajv are installed.
import { createRequire } from "node:module";
import fs from "node:fs";
import path from "node:path";

const [npmDir, out, ...files] = process.argv.slice(2);
if (!npmDir || !out || files.length === 0) {
  console.error("usage: check-dashboards.mjs NPM_DIR OUT DASHBOARD.json...");
  process.exit(2);
}
const require = createRequire(path.join(path.resolve(npmDir), "package.json"));
const tsj = require("ts-json-schema-generator");
const Ajv = require("ajv");

const typesFile = path.join(
  path.dirname(require.resolve("@grafana/schema/package.json")),
  "dist/types/raw/dashboard/x/types.gen.d.ts",
);
const schemaVersion = require("@grafana/schema/package.json").version;
const schema = tsj
  .createGenerator({ path: typesFile, type: "Dashboard", skipTypeCheck: true, expose: "all" })
  .createSchema("Dashboard");
const ajv = new Ajv({ allErrors: true, strict: false });
const validate = ajv.compile(schema);

let failed = 0;
const queries = [];
for (const file of files) {
  const name = path.basename(file);
  let dashboard;
  try {
    dashboard = JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (e) {
    console.error(`${name}: not JSON: ${e.message}`);
    failed++;
    continue;
  }
  if (!validate(dashboard)) {
    failed++;
    for (const err of validate.errors) {
      console.error(`${name}: ${err.instancePath || "/"} ${err.message} ${JSON.stringify(err.params)}`);
    }
    continue;
  }
  const ids = new Set();
  const walk = (panels) => {
    for (const p of panels ?? []) {
      if (ids.has(p.id)) {
        console.error(`${name}: panel id ${p.id} used twice`);
        failed++;
      }
      ids.add(p.id);
      if (p.type !== "row" && (!p.targets || p.targets.length === 0)) {
        console.error(`${name}: panel "${p.title}" has no query`);
        failed++;
      }
      for (const t of p.targets ?? []) queries.push({ dashboard: name, panel: p.title, expr: t.expr });
      walk(p.panels);
    }
  };
  walk(dashboard.panels);
  for (const a of dashboard.annotations?.list ?? []) {
    if (a.target?.expr) queries.push({ dashboard: name, panel: `annotation ${a.name}`, expr: a.target.expr });
  }
  console.log(`${name}: valid against @grafana/schema ${schemaVersion} Dashboard (${ids.size} panels)`);
}
fs.writeFileSync(out, queries.map((q) => JSON.stringify(q)).join("\n") + "\n");
process.exit(failed ? 1 : 0);
