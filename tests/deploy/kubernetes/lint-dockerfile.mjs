// Lints Dockerfiles with dockerfile-utils (the linter of the Dockerfile
// language server; installed by scripts/setup-node-tools): every
// diagnostic, warning or error, is a failure.
//
// With --context=DIR (the build context, the repository's root) it also
// checks what the linter cannot: every COPY/ADD source from the context
// exists there and, where the Dockerfile has an ignore file of its own
// (FILE.dockerignore beside it, in the allow-list style "*" then
// "!path" lines), is one that file lets through. With --cmake=PATH as well, the files that the stage named
// "build" copies are laid out as that stage lays them out, and CMake must
// configure the project from them alone (the COPY list misses nothing the
// build reads) and offer every target the stage's `--target` builds.
//
//   node lint-dockerfile.mjs [--tools=DIR] [--context=DIR [--cmake=PATH]] FILE...
//   (a directory stands for its files named *Dockerfile)
//   node lint-dockerfile.mjs --expect-invalid ... BAD_FILE...
//
// --expect-invalid: each file must be rejected, for the reasons its
// "# expect: TEXT" lines give. Exit status 0: as expected; 1: not; 2: bad
// usage. DIR defaults to $DELTAD_NODE_TOOLS, else /opt/deltad-node-tools.
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

import * as cli from "./cli.mjs";

const USAGE = "usage: node lint-dockerfile.mjs [--tools=DIR] " +
              "[--context=DIR [--cmake=PATH]] [--expect-invalid] FILE...";

function parseArgs(argv) {
  const options = cli.parseArgs(argv, {
    program: "lint-dockerfile.mjs",
    usage: USAGE,
    valued: ["tools", "context", "cmake"],
    fileName: /Dockerfile$/,
  });
  if (options.cmake && !options.context) {
    console.error(`lint-dockerfile.mjs: --cmake needs --context\n${USAGE}`);
    process.exit(2);
  }
  return options;
}

function loadTools(dir) {
  const require = cli.toolsRequire("lint-dockerfile.mjs", dir);
  return {
    utils: require("dockerfile-utils"),
    ast: require("dockerfile-ast"),
    version: require("dockerfile-utils/package.json").version,
  };
}

function lint(tools, file, text, problems) {
  for (const d of tools.utils.validate(text)) {
    const severity = d.severity === 1 ? "error" : "warning";
    problems.push(`${file}:${d.range.start.line + 1}:` +
                  `${d.range.start.character + 1}: ${severity}: ${d.message}`);
  }
}

// The instructions, each with its stage's name and working directory then.
function instructions(tools, text) {
  const out = [];
  let stage = null;
  let workdir = "/";
  for (const i of tools.ast.DockerfileParser.parse(text).getInstructions()) {
    const keyword = i.getKeyword();
    if (keyword === "FROM") {
      stage = i.getBuildStage();
      workdir = "/";
    } else if (keyword === "WORKDIR" && i.getArguments().length > 0) {
      workdir = path.posix.resolve(workdir, i.getArguments()[0].getValue());
    }
    out.push({ instruction: i, keyword, stage, workdir,
               line: i.getRange().start.line + 1 });
  }
  return out;
}

// COPY/ADD from the build context:
// [{ line, stage, sources, dest, destIsDir }].
function contextCopies(list) {
  const copies = [];
  for (const { instruction, keyword, stage, workdir, line } of list) {
    if (keyword !== "COPY" && keyword !== "ADD") continue;
    if (instruction.getFlags().some((f) => f.getName() === "from")) continue;
    const args = instruction.getArguments().map((a) => a.getValue());
    if (args.length < 2) continue;  // the linter says so
    const sources = args.slice(0, -1).filter((s) => !/^[a-z]+:\/\//.test(s));
    const last = args[args.length - 1];
    copies.push({ line, stage, sources, dest: path.posix.resolve(workdir, last),
                  destIsDir: last.endsWith("/") });
  }
  return copies;
}

// The paths an allow-list ignore file ("*", then "!path" lines) lets
// through; null when there is no such file.
function allowed(file) {
  const ignore = `${file}.dockerignore`;
  if (!fs.existsSync(ignore)) return null;
  const lines = fs.readFileSync(ignore, "utf8").split("\n")
    .map((l) => l.trim()).filter((l) => l && !l.startsWith("#"));
  if (lines[0] !== "*") return null;
  return lines.filter((l) => l.startsWith("!"))
    .map((l) => l.slice(1).replace(/^\.\//, "").replace(/\/+$/, ""));
}

function checkContext(file, copies, context, problems) {
  const through = allowed(file);
  for (const { line, sources } of copies) {
    for (const s of sources) {
      const full = path.resolve(context, s);
      if (!full.startsWith(path.resolve(context) + path.sep) ||
          !fs.existsSync(full)) {
        problems.push(`${file}:${line}: COPY source ${s} is not in the build ` +
                      `context ${context}`);
      }
      const rel = s.replace(/^\.\//, "").replace(/\/+$/, "");
      if (through !== null &&
          !through.some((p) => rel === p || rel.startsWith(`${p}/`))) {
        problems.push(`${file}:${line}: COPY source ${s} is left out of the ` +
                      `context by ${path.basename(file)}.dockerignore`);
      }
    }
  }
}

// Lays out what the "build" stage copies, configures with CMake and checks
// the targets its build line names.
function checkConfigure(file, list, copies, options, problems) {
  const build = copies.filter((c) => c.stage === "build");
  const run = list.find((i) => i.stage === "build" && i.keyword === "RUN" &&
    /cmake -S /.test(i.instruction.getArgumentsContent() || ""));
  if (build.length === 0 || run === undefined) {
    problems.push(`${file}: no stage "build" that copies sources and runs ` +
                  "cmake -S");
    return;
  }
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "deltad-docker-"));
  try {
    const root = path.join(tmp, "root");
    for (const { sources, dest, destIsDir } of build) {
      for (const s of sources) {
        const from = path.resolve(options.context, s);
        if (!fs.existsSync(from)) continue;  // checkContext says so
        // Docker's rules: a directory's contents go into dest; a file goes
        // into dest when dest ends in "/" or there are several sources,
        // else it becomes dest.
        const into = fs.statSync(from).isDirectory() ? path.join(root, dest)
          : destIsDir || sources.length > 1
            ? path.join(root, dest, path.basename(s)) : path.join(root, dest);
        fs.cpSync(from, into, { recursive: true });
      }
    }
    const source = path.join(root, run.workdir);
    const binary = path.join(tmp, "build");
    const configure = spawnSync(options.cmake, [
      "-S", source, "-B", binary, "-DCMAKE_INSTALL_PREFIX=/usr",
      "-DDELTAD_BUILD_TESTS=OFF", "-DDELTAD_BUILD_BENCH=OFF",
      "-DDELTAD_CUDA=OFF"], { encoding: "utf8", timeout: 300000 });
    if (configure.status !== 0) {
      problems.push(`${file}: CMake cannot configure from what the build ` +
                    `stage copies: ${(configure.stderr || String(configure.error))
                      .trim().split("\n").slice(0, 8).join(" | ")}`);
      return;
    }
    const help = spawnSync(options.cmake, ["--build", binary, "--target", "help"],
                           { encoding: "utf8", timeout: 120000 });
    const offered = `${help.stdout}`;
    const m = /--target ((?:[A-Za-z0-9_.+-]+ ?)+)/.exec(
      run.instruction.getArgumentsContent());
    for (const target of m ? m[1].trim().split(/\s+/) : []) {
      if (!new RegExp(`(^|[\\s.:])${target.replace(/[.+]/g, "\\$&")}(:|\\s|$)`, "m")
            .test(offered)) {
        problems.push(`${file}:${run.line}: the build has no target ${target}`);
      }
    }
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
}

function check(tools, file, options) {
  const problems = [];
  let text;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (e) {
    return [`${file}: ${e.message}`];
  }
  lint(tools, file, text, problems);
  if (options.context) {
    const list = instructions(tools, text);
    const copies = contextCopies(list);
    checkContext(file, copies, options.context, problems);
    if (options.cmake && problems.length === 0) {
      checkConfigure(file, list, copies, options, problems);
    }
  }
  return problems;
}

const options = parseArgs(process.argv.slice(2));
const tools = loadTools(options.tools);
console.log(`lint-dockerfile.mjs: dockerfile-utils ${tools.version}`);

if (!options.expectInvalid) {
  let failed = 0;
  for (const file of options.files) {
    const problems = check(tools, file, options);
    for (const p of problems) console.log(`FAIL ${p}`);
    if (problems.length > 0) ++failed;
  }
  console.log(`${options.files.length - failed} of ${options.files.length} ` +
              "Dockerfiles clean");
  process.exit(failed === 0 ? 0 : 1);
}

cli.expectRejected(options.files, (file) => check(tools, file, options),
                   "Dockerfiles");
