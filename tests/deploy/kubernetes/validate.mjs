// Validates Kubernetes manifests (every YAML document of every file given)
// against the schemas of the Kubernetes API, with the validators that
// kubernetes-models and @kubernetes-models/prometheus-operator generate from
// the API's OpenAPI document and the operator's CRDs (ajv), installed by
// scripts/setup-node-tools. A document whose apiVersion and kind no package
// knows is a failure, as is YAML that does not parse (read as YAML 1.1, the
// way Kubernetes reads it: `on` and `yes` are booleans there).
//
// Then what a schema cannot see, across the documents: names the API
// server would refuse, workload selectors that miss their pod template,
// volume mounts without a volume, ConfigMap volumes whose map or keys are
// not among the files, Services that select no pod or name no port of it,
// ServiceMonitors that select no Service or name no port of it.
//
// With --deltad=PATH, every ConfigMap key deltad.conf, and the arguments of
// every container whose command is deltad (its --config resolved through the
// container's mounts to the ConfigMap key), go through the real daemon's
// --print_config, which parses and checks the configuration. With
// --deltactl=PATH, every exec probe that runs deltactl runs it against a
// socket where nothing listens: it must get as far as "cannot reach
// deltad" (a command line deltactl takes).
//
//   node validate.mjs [--tools=DIR] [--deltad=PATH] [--deltactl=PATH] FILE...
//   (a directory stands for its *.yaml and *.yml files)
//   node validate.mjs --expect-invalid ... BAD_FILE...
//
// --expect-invalid turns it around: each file, validated alone, must be
// rejected, for the reasons its "# expect: TEXT" lines give (each TEXT must
// appear in a failure message). Exit status 0: as expected; 1: not; 2: bad
// usage. DIR defaults to $DELTAD_NODE_TOOLS, else /opt/deltad-node-tools.
import { spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";

import * as cli from "./cli.mjs";

const USAGE =
  "usage: node validate.mjs [--tools=DIR] [--deltad=PATH] [--deltactl=PATH] " +
  "[--expect-invalid] FILE...";

function parseArgs(argv) {
  return cli.parseArgs(argv, {
    program: "validate.mjs",
    usage: USAGE,
    valued: ["tools", "deltad", "deltactl"],
    fileName: /\.ya?ml$/,
  });
}

// The installed tools, or an exit that says how to install them: a missing
// validator is a failure, never a skip.
function loadTools(dir) {
  const require = cli.toolsRequire("validate.mjs", dir);
  const version = (name) => require(`${name}/package.json`).version;
  return {
    require,
    YAML: require("yaml"),
    versions: ["kubernetes-models", "@kubernetes-models/prometheus-operator",
               "yaml"].map((n) => `${n} ${version(n)}`),
  };
}

// Model packages, tried in order for an apiVersion: each exports one module
// per group/version, holding a class per kind.
const MODEL_PACKAGES = ["kubernetes-models",
                        "@kubernetes-models/prometheus-operator"];

function modelFor(tools, apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string" ||
      !/^([a-z0-9]([a-z0-9.-]*[a-z0-9])?\/)?v[0-9]+((alpha|beta)[0-9]+)?$/
        .test(apiVersion) ||
      !/^[A-Z][A-Za-z0-9]*$/.test(kind)) {
    return null;
  }
  for (const pkg of MODEL_PACKAGES) {
    let module;
    try {
      module = tools.require(`${pkg}/${apiVersion}`);
    } catch (e) {
      if (e.code === "MODULE_NOT_FOUND" ||
          e.code === "ERR_PACKAGE_PATH_NOT_EXPORTED") {
        continue;
      }
      throw e;
    }
    const model = module[kind];
    // Only top-level resources carry their apiVersion and kind.
    if (typeof model === "function" && model.apiVersion === apiVersion &&
        model.kind === kind) {
      return model;
    }
  }
  return null;
}

// One YAML document of a file, once parsed.
class Doc {
  constructor(file, index, object) {
    this.file = file;
    this.index = index;  // 1-based, counting documents with content
    this.object = object;
  }
  get kind() { return this.object?.kind; }
  get name() { return this.object?.metadata?.name; }
  get namespace() { return this.object?.metadata?.namespace || ""; }
  where() {
    return `${this.file}: document ${this.index} ` +
           `(${this.kind ?? "no kind"}/${this.name ?? "no name"})`;
  }
}

function parseFile(tools, file, problems) {
  let text;
  try {
    text = fs.readFileSync(file, "utf8");
  } catch (e) {
    problems.push(`${file}: ${e.message}`);
    return [];
  }
  const docs = [];
  let index = 0;
  for (const doc of tools.YAML.parseAllDocuments(text, {
         version: "1.1", uniqueKeys: true, prettyErrors: true})) {
    if (doc.contents === null && doc.errors.length === 0) continue;
    ++index;
    if (doc.errors.length > 0) {
      for (const e of doc.errors) {
        problems.push(`${file}: document ${index}: YAML: ${e.message}`);
      }
      continue;
    }
    const object = doc.toJS({ maxAliasCount: 100 });
    if (object === null || typeof object !== "object" || Array.isArray(object)) {
      problems.push(`${file}: document ${index}: not a Kubernetes object ` +
                    "(a mapping with apiVersion and kind)");
      continue;
    }
    docs.push(new Doc(file, index, object));
  }
  return docs;
}

function validateSchema(tools, doc, problems) {
  const { apiVersion, kind } = doc.object;
  const model = modelFor(tools, apiVersion, kind);
  if (model === null) {
    problems.push(`${doc.where()}: unknown kind ${kind} of apiVersion ` +
                  `${apiVersion} (no schema for it in ${MODEL_PACKAGES.join(", ")})`);
    return;
  }
  try {
    new model(doc.object).validate();
  } catch (e) {
    problems.push(`${doc.where()}: ${e.message}`);
  }
}

// ---- across documents -------------------------------------------------------

const SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
// Kinds whose names are DNS labels (63 characters, no dots).
const LABEL_NAMED = new Set(["Namespace", "Service"]);
const WORKLOADS = new Set(["DaemonSet", "Deployment", "StatefulSet",
                           "ReplicaSet", "Job"]);

// The pod spec a document runs and the labels its pods carry, if any.
function podOf(doc) {
  const o = doc.object;
  if (o.kind === "Pod") return { spec: o.spec, labels: o.metadata?.labels || {} };
  if (WORKLOADS.has(o.kind)) {
    return { spec: o.spec?.template?.spec,
             labels: o.spec?.template?.metadata?.labels || {} };
  }
  if (o.kind === "CronJob") {
    const t = o.spec?.jobTemplate?.spec?.template;
    return { spec: t?.spec, labels: t?.metadata?.labels || {} };
  }
  return null;
}

function containersOf(spec) {
  return [...(spec?.initContainers || []), ...(spec?.containers || [])];
}

function matches(matchLabels, labels) {
  const entries = Object.entries(matchLabels || {});
  return entries.length > 0 && entries.every(([k, v]) => labels[k] === v);
}

function crossCheck(docs, problems) {
  const configMaps = new Map();  // namespace/name -> data keys
  for (const d of docs) {
    if (d.kind === "ConfigMap") {
      configMaps.set(`${d.namespace}/${d.name}`, new Set([
        ...Object.keys(d.object.data || {}),
        ...Object.keys(d.object.binaryData || {})]));
    }
  }
  const pods = docs.map((d) => ({ doc: d, pod: podOf(d) })).filter((p) => p.pod);
  const services = docs.filter((d) => d.kind === "Service");

  for (const d of docs) {
    const name = d.object.metadata?.name;
    if (name === undefined && d.object.metadata?.generateName === undefined) {
      problems.push(`${d.where()}: metadata.name is missing`);
    } else if (name !== undefined) {
      const ok = LABEL_NAMED.has(d.kind)
        ? LABEL.test(name) && name.length <= 63
        : SUBDOMAIN.test(name) && name.length <= 253;
      if (!ok) {
        problems.push(`${d.where()}: metadata.name "${name}" is not a valid ` +
                      `DNS-1123 ${LABEL_NAMED.has(d.kind) ? "label" : "subdomain"}`);
      }
    }
  }

  for (const { doc, pod } of pods) {
    const selector = doc.object.spec?.selector?.matchLabels;
    if (WORKLOADS.has(doc.kind) && doc.kind !== "Job" &&
        !matches(selector, pod.labels)) {
      problems.push(`${doc.where()}: spec.selector.matchLabels does not match ` +
                    "the pod template's labels");
    }
    const volumes = new Map((pod.spec?.volumes || []).map((v) => [v.name, v]));
    for (const c of containersOf(pod.spec)) {
      const seen = new Set();
      for (const p of c.ports || []) {
        if (p.name !== undefined && (!LABEL.test(p.name) || p.name.length > 15)) {
          problems.push(`${doc.where()}: container ${c.name}: port name ` +
                        `"${p.name}" is not an IANA service name`);
        }
        if (p.name !== undefined) seen.add(p.name);
      }
      for (const m of c.volumeMounts || []) {
        const v = volumes.get(m.name);
        if (v === undefined) {
          problems.push(`${doc.where()}: container ${c.name} mounts volume ` +
                        `${m.name}, which the pod does not have`);
          continue;
        }
        if (v.configMap === undefined || m.subPath === undefined) continue;
        // A subPath of a ConfigMap volume is one of its files.
        const files = v.configMap.items
          ? v.configMap.items.map((i) => i.path) : null;
        const keys = configMaps.get(`${doc.namespace}/${v.configMap.name}`);
        if ((files && !files.includes(m.subPath)) ||
            (!files && keys && !keys.has(m.subPath))) {
          problems.push(`${doc.where()}: container ${c.name} mounts ` +
                        `${m.subPath} of volume ${m.name}, which has no such file`);
        }
      }
    }
    for (const v of pod.spec?.volumes || []) {
      if (v.configMap === undefined || v.configMap.optional) continue;
      const keys = configMaps.get(`${doc.namespace}/${v.configMap.name}`);
      if (keys === undefined) {
        problems.push(`${doc.where()}: volume ${v.name}: ConfigMap ` +
                      `${v.configMap.name} is not among these files`);
        continue;
      }
      for (const item of v.configMap.items || []) {
        if (!keys.has(item.key)) {
          problems.push(`${doc.where()}: volume ${v.name}: ConfigMap ` +
                        `${v.configMap.name} has no key ${item.key}`);
        }
      }
    }
  }

  for (const s of services) {
    const selector = s.object.spec?.selector;
    if (selector === undefined) continue;  // endpoints managed elsewhere
    const selected = pods.filter(({ doc, pod }) =>
      doc.namespace === s.namespace && matches(selector, pod.labels));
    if (selected.length === 0) {
      problems.push(`${s.where()}: spec.selector selects no pod of these files`);
      continue;
    }
    const portNames = new Set(selected.flatMap(({ pod }) =>
      containersOf(pod.spec).flatMap((c) => (c.ports || []).map((p) => p.name))));
    for (const p of s.object.spec?.ports || []) {
      if (typeof p.targetPort === "string" && !portNames.has(p.targetPort)) {
        problems.push(`${s.where()}: port ${p.name ?? p.port}: targetPort ` +
                      `"${p.targetPort}" is no container port of the pods it selects`);
      }
    }
  }

  for (const m of docs.filter((d) => d.kind === "ServiceMonitor")) {
    const spec = m.object.spec || {};
    const namespaces = spec.namespaceSelector?.any ? null
      : spec.namespaceSelector?.matchNames || [m.namespace];
    const selected = services.filter((s) =>
      (namespaces === null || namespaces.includes(s.namespace)) &&
      matches(spec.selector?.matchLabels, s.object.metadata?.labels || {}));
    if (selected.length === 0) {
      problems.push(`${m.where()}: spec.selector selects no Service of these files`);
      continue;
    }
    const portNames = new Set(selected.flatMap((s) =>
      (s.object.spec?.ports || []).map((p) => p.name)));
    for (const e of spec.endpoints || []) {
      if (e.port !== undefined && !portNames.has(e.port)) {
        problems.push(`${m.where()}: endpoint port "${e.port}" is no port ` +
                      "of the Services it selects");
      }
    }
  }
}

// ---- the real deltad and deltactl ------------------------------------------

function run(binary, args) {
  const r = spawnSync(binary, args, { encoding: "utf8", timeout: 30000 });
  if (r.error) return { status: null, output: String(r.error) };
  // The first line says why; deltactl's usage text after it does not.
  const output = `${r.stdout}${r.stderr}`.trim().split("\n")[0];
  return { status: r.status, output };
}

function basename(command) {
  return typeof command === "string" ? path.basename(command) : "";
}

// The ConfigMap key that a container sees at `file`, through its mounts.
function configMapFileAt(docs, doc, pod, container, file) {
  const volumes = new Map((pod.spec?.volumes || []).map((v) => [v.name, v]));
  for (const m of container.volumeMounts || []) {
    const v = volumes.get(m.name);
    if (!v?.configMap) continue;
    let inVolume;
    if (m.subPath !== undefined) {
      if (m.mountPath !== file) continue;
      inVolume = m.subPath;
    } else if (file.startsWith(m.mountPath.replace(/\/*$/, "/"))) {
      inVolume = file.slice(m.mountPath.replace(/\/*$/, "/").length);
    } else {
      continue;
    }
    const item = (v.configMap.items || []).find((i) => i.path === inVolume);
    const key = v.configMap.items ? item?.key : inVolume;
    const map = docs.find((d) => d.kind === "ConfigMap" &&
      d.namespace === doc.namespace && d.name === v.configMap.name);
    const text = key === undefined ? undefined : map?.object.data?.[key];
    if (text !== undefined) return text;
  }
  return undefined;
}

function checkWithBinaries(docs, options, problems) {
  const counts = { configs: 0, commands: 0, probes: 0 };
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "deltad-k8s-"));
  try {
    let n = 0;
    const write = (text) => {
      const file = path.join(tmp, `deltad-${++n}.conf`);
      fs.writeFileSync(file, text);
      return file;
    };
    if (options.deltad) {
      for (const d of docs.filter((x) => x.kind === "ConfigMap")) {
        const text = d.object.data?.["deltad.conf"];
        if (text === undefined) continue;
        ++counts.configs;
        const r = run(options.deltad, [`--config=${write(text)}`, "--print_config"]);
        if (r.status !== 0) {
          problems.push(`${d.where()}: data deltad.conf: deltad --print_config ` +
                        `refused it: ${r.output}`);
        }
      }
    }
    for (const d of docs) {
      const pod = podOf(d);
      if (pod === null) continue;
      for (const c of containersOf(pod.spec)) {
        if (options.deltad && basename(c.command?.[0]) === "deltad") {
          const args = [];
          let bad = null;
          for (const a of [...c.command.slice(1), ...(c.args || [])]) {
            const m = /^--config=(.*)$/.exec(a);
            if (m === null) { args.push(a); continue; }
            const text = configMapFileAt(docs, d, pod, c, m[1]);
            if (text === undefined) {
              bad = `--config=${m[1]} is no ConfigMap file mounted in the container`;
            } else {
              args.push(`--config=${write(text)}`);
            }
          }
          ++counts.commands;
          const r = bad ? null : run(options.deltad, [...args, "--print_config"]);
          if (bad || r.status !== 0) {
            problems.push(`${d.where()}: container ${c.name}: ` +
                          (bad || `deltad ${args.join(" ")} refused its ` +
                                  `arguments: ${r.output}`));
          }
        }
        if (!options.deltactl) continue;
        for (const probe of ["startupProbe", "readinessProbe", "livenessProbe"]) {
          const command = c[probe]?.exec?.command;
          if (basename(command?.[0]) !== "deltactl") continue;
          // Where nothing listens, whatever the probe names (or defaults to).
          const args = [`--socket=${path.join(tmp, "none.sock")}`,
                        ...command.slice(1).filter((a) =>
                          !/^--(socket|tcp)=/.test(a))];
          ++counts.probes;
          const r = run(options.deltactl, args);
          if (r.status !== 1 || !r.output.includes("cannot reach deltad")) {
            problems.push(`${d.where()}: container ${c.name}: ${probe} ` +
                          `"${command.join(" ")}" is not a deltactl command ` +
                          `line (exit ${r.status}): ${r.output}`);
          }
        }
      }
    }
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
  return counts;
}

// ---- main ------------------------------------------------------------------

function validateFiles(tools, files, options) {
  const problems = [];
  const docs = files.flatMap((f) => parseFile(tools, f, problems));
  for (const d of docs) validateSchema(tools, d, problems);
  crossCheck(docs, problems);
  const counts = options.deltad || options.deltactl
    ? checkWithBinaries(docs, options, problems) : null;
  return { docs, problems, counts };
}

const options = parseArgs(process.argv.slice(2));
const tools = loadTools(options.tools);
console.log(`validate.mjs: schemas of ${tools.versions.join(", ")}`);

if (!options.expectInvalid) {
  const { docs, problems, counts } =
    validateFiles(tools, options.files, options);
  for (const p of problems) console.log(`FAIL ${p}`);
  if (counts) {
    console.log(`through deltad --print_config: ${counts.configs} deltad.conf, ` +
                `${counts.commands} deltad command lines; through deltactl: ` +
                `${counts.probes} probes`);
  }
  console.log(`${docs.length} documents in ${options.files.length} files: ` +
              `${problems.length === 0 ? "valid" : `${problems.length} problems`}`);
  process.exit(problems.length === 0 ? 0 : 1);
}

cli.expectRejected(
  options.files,
  (file) => validateFiles(tools, [file], options).problems, "files");
