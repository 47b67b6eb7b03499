// The playground: the three routes side by side for one query, and the served bundle.
// Plain DOM code, no build step; every text from the service goes through textContent.
"use strict";

const ROUTES = ["single", "hybrid", "ranked", "diffusion", "ar"];

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// The service's error envelope as one line: "422 InputError: body.k: Input should be ...".
function errorText(status, body) {
  const error = (body && body.error) || {};
  const details = (error.details || []).map((d) => `${d.loc}: ${d.message}`).join("; ");
  const message = error.message || "no message";
  return `${status} ${error.type || ""}: ${message}${details && !message.includes(details) ? ` (${details})` : ""}`;
}

async function retrieve(route, query, k) {
  const response = await fetch("/v1/retrieve", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ query, k, route }),
  });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new Error(errorText(response.status, body));
  return body;
}

function why(item, answer) {
  if (item.slot === null) return "filled from the query's dense neighbours";
  if (answer.route === "ar" && answer.subqueries && answer.subqueries[item.slot] !== undefined) {
    return `sub-query ${item.slot}: “${answer.subqueries[item.slot]}”`;
  }
  if (answer.route === "ranked") return `pick ${item.slot + 1}`;
  if (answer.route === "hybrid") return `candidate ${item.slot + 1}`;
  return answer.route === "single" ? "the query itself" : `row ${item.slot}`;
}

function meta(answer) {
  const box = el("div");
  box.append(el("span", "", `answered by ${answer.route} · groundedness ${answer.groundedness.toFixed(3)}`));
  if (answer.fallback.used) {
    box.append(el("span", "fallback", ` · fallback (${answer.fallback.reason})`));
  }
  const stages = Object.entries(answer.timings_ms).map(([stage, ms]) => `${stage} ${ms.toFixed(1)}`);
  box.append(el("div", "", `ms: ${stages.join(" · ")}`));
  for (const note of answer.notes) box.append(el("div", "", note));
  return box;
}

function show(column, answer, singleIds) {
  const list = column.querySelector(".items");
  list.replaceChildren();
  for (const item of answer.items) {
    const li = el("li", "item");
    li.dataset.id = item.id;
    li.append(el("span", "text", item.text));
    const line = el("span", "why", `score ${item.score.toFixed(3)} · ${why(item, answer)}`);
    li.append(line);
    if (singleIds && column.dataset.route !== "single" && !singleIds.has(item.id)) {
      li.classList.add("fanout-only");
      line.append(" ", el("mark", "only", "fan-out only"));
    }
    list.append(li);
  }
  column.querySelector(".meta").replaceChildren(meta(answer));
}

function fail(column, message) {
  column.querySelector(".items").replaceChildren();
  column.querySelector(".meta").replaceChildren(el("div", "error", message));
  column.dataset.state = "error";
}

async function compare(event) {
  event.preventDefault();
  const query = document.getElementById("query").value;
  const kText = document.getElementById("k").value;
  const k = /^\d+$/.test(kText.trim()) ? Number(kText) : kText;  // the service judges k
  const columns = ROUTES.map((route) => document.querySelector(`.route[data-route="${route}"]`));
  for (const column of columns) column.dataset.state = "loading";
  const started = performance.now();
  const results = await Promise.allSettled(ROUTES.map((route) => retrieve(route, query, k)));
  const elapsed = Math.round(performance.now() - started);
  const status = document.getElementById("elapsed");
  status.dataset.ms = String(elapsed);
  status.textContent = `all four answered in ${elapsed} ms (in the browser)`;
  const single = results[0].status === "fulfilled" ? results[0].value : null;
  const singleIds = single ? new Set(single.items.map((item) => item.id)) : null;
  results.forEach((result, i) => {
    if (result.status === "fulfilled") {
      show(columns[i], result.value, singleIds);
      columns[i].dataset.state = "done";
    } else {
      fail(columns[i], result.reason.message);
    }
  });
}

function entries(pairs) {
  const list = el("dl");
  for (const [key, value] of pairs) {
    if (value === undefined || value === null) continue;
    list.append(el("dt", "", key));
    list.append(el("dd", "", typeof value === "object" ? JSON.stringify(value) : String(value)));
  }
  return list;
}

async function loadInfo() {
  const box = document.getElementById("info");
  box.dataset.state = "loading";
  const response = await fetch("/v1/info");
  const info = await response.json().catch(() => null);
  if (!response.ok || !info) {
    box.replaceChildren(el("div", "error", errorText(response.status, info)));
    box.dataset.state = "error";
    return;
  }
  const served = info.served || {};
  const bundle = served.bundle || {};
  const manifest = bundle.manifest || {};
  const sampler = ((served.paths || {}).diffusion || {}).config || {};
  box.replaceChildren(
    el("h3", "", "Bundle"),
    entries([["name", bundle.name], ["status", info.status], ["items", manifest.n_items],
             ["encoder", manifest.encoder], ["routes", Object.keys(served.paths || {}).join(", ")],
             ["unavailable", served.unavailable], ["routing", served.routing]]),
    el("h3", "", "Diffusion sampler"),
    entries([["solver", sampler.solver], ["steps", sampler.steps], ["draws", sampler.draws],
             ["CFG weight", sampler.cfg_weight], ["context", sampler.context],
             ["context source", sampler.context_source], ["candidates", sampler.candidates],
             ["params", sampler.params], ["FLOPs / query", sampler.flops_per_query],
             ["providers", (served.providers || {}).diffusion]]),
    el("h3", "", "Provenance"),
    entries([["created", manifest.created], ["updated", manifest.updated],
             ["commit", manifest.git_commit], ["seed", manifest.seed],
             ...Object.entries(manifest.stages || {}).map(
               ([name, stage]) => [`stage ${name}`, `${stage.finished} · commit ${String(stage.git_commit).slice(0, 10)}`])]),
  );
  box.dataset.state = "done";
}

function selectTab(name) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.setAttribute("aria-selected", String(tab.dataset.tab === name));
  }
  for (const panel of document.querySelectorAll(".panel")) panel.hidden = panel.id !== name;
  if (name === "bundle") loadInfo();
}

document.getElementById("ask").addEventListener("submit", compare);
for (const tab of document.querySelectorAll(".tab")) {
  tab.addEventListener("click", () => selectTab(tab.dataset.tab));
}
