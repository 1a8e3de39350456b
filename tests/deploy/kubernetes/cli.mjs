// What the two checkers (validate.mjs, lint-dockerfile.mjs) share: their
// command line and finding the pinned Node.js tools.
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";

// Parses `--name=value` options (those in `valued`), `--expect-invalid` and
// files; a directory stands for its files whose names match `fileName`.
// Exits 2 with `usage` on anything else or no file.
export function parseArgs(argv, { program, usage, valued, fileName }) {
  const options = {
    tools: process.env.DELTAD_NODE_TOOLS || "/opt/deltad-node-tools",
    expectInvalid: false,
    files: [],
  };
  for (const name of valued) {
    if (name !== "tools") options[name] = null;
  }
  for (const arg of argv) {
    const m = /^--([a-z-]+)(?:=(.*))?$/.exec(arg);
    if (!m) {
      options.files.push(arg);
    } else if (m[1] === "expect-invalid" && m[2] === undefined) {
      options.expectInvalid = true;
    } else if (valued.includes(m[1]) && m[2]) {
      options[m[1]] = m[2];
    } else {
      console.error(`${program}: unknown option ${arg}\n${usage}`);
      process.exit(2);
    }
  }
  options.files = options.files.flatMap((f) =>
    fs.existsSync(f) && fs.statSync(f).isDirectory()
      ? fs.readdirSync(f).filter((n) => fileName.test(n)).sort()
          .map((n) => path.join(f, n))
      : [f]);
  if (options.files.length === 0) {
    console.error(`${program}: no files given\n${usage}`);
    process.exit(2);
  }
  return options;
}

// A require() for the installed tools, or an exit that says how to install
// them: a missing validator is a failure, never a skip.
export function toolsRequire(program, dir) {
  if (!fs.existsSync(path.join(dir, "node_modules", ".package-lock.json"))) {
    console.error(
      `${program}: the Node.js tools are not installed in ${dir}: run ` +
        "scripts/setup (or scripts/setup-node-tools; DELTAD_NODE_TOOLS " +
        "chooses another directory)");
    process.exit(1);
  }
  return createRequire(path.join(dir, "package.json"));
}

// --expect-invalid: every file is broken on purpose and names, in lines
// `# expect: TEXT`, what its problems must say. `problemsOf(file)` checks
// one file. Exits 0 when every file is rejected for its stated reasons.
export function expectRejected(files, problemsOf, what) {
  let wrong = 0;
  for (const file of files) {
    const expected = [...fs.readFileSync(file, "utf8")
      .matchAll(/^# expect: (.+)$/gm)].map((m) => m[1].trim());
    const problems = problemsOf(file);
    const missing =
      expected.filter((e) => !problems.some((p) => p.includes(e)));
    if (problems.length > 0 && missing.length === 0) {
      console.log(`rejected as expected: ${problems.join("\n    ")}`);
    } else {
      ++wrong;
      console.log(`FAIL ${file}: ` + (problems.length === 0
        ? "accepted, but it is broken on purpose"
        : `rejected, but not for "${missing.join("\", \"")}": ` +
          problems.join("; ")));
    }
  }
  console.log(`${files.length - wrong} of ${files.length} broken ${what} ` +
              "rejected as expected");
  process.exit(wrong === 0 ? 0 : 1);
}
