// The Stepline dashboard page: three views over the JSON API of stepline/dashboard/app.py.
//   #/run              charts of the trainer's metrics and the pool's episodes, evaluations
//   #/episodes?…       the paged, filtered episodes table (paging and filtering happen on the server)
//   #/episode/<id>     one session's tree of steps, action tokens shaded by logprob
//   #/groups?…         the paged groups table (one row per task × harness group)
//   #/group/<key>      one group's episodes side by side with the advantages the trainer would compute
"use strict";

const view = document.getElementById("view");
const token = new URLSearchParams(location.search).get("token");
let info = { poll_s: 2, charts: false };
let timer = null;
let plots = {};

async function api(path) {
  const headers = token ? { Authorization: "Bearer " + token } : {};
  const response = await fetch(path, { headers, credentials: "same-origin" });
  const body = await response.json();
  if (!response.ok) throw new Error((body.error && body.error.message) || response.statusText);
  return body;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const child of children) node.append(child instanceof Node ? child : String(child ?? ""));
  return node;
}

const fmt = (v, d = 3) => (v === null || v === undefined ? "–" : typeof v === "number" ? +v.toFixed(d) : v);
const setStatus = (text, bad) => { const s = document.getElementById("status"); s.textContent = text; s.className = bad ? "error" : "dim"; };

// ---------- run view ----------

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"];

function drawChart(key, chart, box) {
  const data = [chart.x, ...chart.series.map((s) => s.values)];
  const old = plots[key];
  if (old && old.series.length === data.length && document.body.contains(old.root)) { old.setData(data); return; }
  if (old) old.destroy();
  box.textContent = "";
  const opts = {
    width: 420, height: 220, scales: { x: { time: false } },
    axes: [{ label: chart.x_label }, {}],
    series: [{ label: chart.x_label }, ...chart.series.map((s, i) => ({
      label: s.label, stroke: s.color || COLORS[i % COLORS.length], dash: s.dash, width: s.dash ? 1 : 2,
      points: { show: true, size: 5 }, spanGaps: true }))],
  };
  plots[key] = new uPlot(opts, data, box);
}

function chartBox(key, chart, grid) {
  let card = document.getElementById("chart-" + key);
  if (!card) {
    card = el("div", { class: "chart", id: "chart-" + key }, el("h3", {}, chart.title), el("div", { class: "plot" }));
    grid.append(card);
  }
  const points = chart.x.length;
  card.dataset.points = points;
  const box = card.querySelector(".plot");
  if (!info.charts || typeof uPlot === "undefined") {
    box.textContent = `${points} points (charts need uPlot: python -m stepline.assets uplot)`;
  } else if (points) drawChart(key, chart, box);
  else box.textContent = "no data yet";
}

function evalChart(evaluations) {
  const names = [...new Set(evaluations.flatMap((e) => Object.keys(e.harnesses)))].sort();
  const series = [];
  names.forEach((h, i) => {
    const col = (f) => evaluations.map((e) => (e.harnesses[h] ? f(e.harnesses[h]) : null));
    const color = COLORS[i % COLORS.length];
    series.push({ label: h, values: col((s) => s.rate), color });
    series.push({ label: h + " 95% low", values: col((s) => s.ci95[0]), color, dash: [4, 4] });
    series.push({ label: h + " 95% high", values: col((s) => s.ci95[1]), color, dash: [4, 4] });
  });
  return { title: "test success at each evaluation (" + evaluations.map((e, i) => `${i}=${e.tag}`).join(", ") + ")",
           x_label: "evaluation", x: evaluations.map((_, i) => i), series };
}

function evalTable(evaluations) {
  const names = [...new Set(evaluations.flatMap((e) => Object.keys(e.harnesses)))].sort();
  const head = el("tr", {}, el("th", {}, "evaluation"), el("th", {}, "version"), ...names.map((h) => el("th", {}, h)));
  const rows = evaluations.map((e) => el("tr", {}, el("td", {}, e.tag), el("td", {}, fmt(e.weight_version)),
    ...names.map((h) => { const s = e.harnesses[h]; return el("td", {}, s ? `${fmt(s.rate)} [${fmt(s.ci95[0], 2)}, ${fmt(s.ci95[1], 2)}] n=${s.n}` : "–"); })));
  return el("table", { id: "evals" }, head, ...rows);
}

async function showRun() {
  if (!document.getElementById("run-view")) {
    plots = {};
    view.replaceChildren(el("div", { id: "run-view" }, el("p", { id: "run-head", class: "dim" }),
      el("h2", {}, "Rollouts (from the pool)"), el("div", { class: "charts", id: "pool-charts" }),
      el("h2", {}, "Test success"), el("div", { id: "eval-box" }),
      el("h2", {}, "Trainer (metrics.jsonl)"), el("div", { class: "charts", id: "trainer-charts" })));
  }
  const run = await api("/api/run");
  const s = run.pool_stats || {};
  const phases = Object.entries(run.phases || {}).map(([k, v]) => `${k} ${(v / 60).toFixed(1)} min`).join(", ");
  document.getElementById("run-head").textContent = `${run.updates} updates · sessions ${s.sessions ?? "–"} · ` +
    `episodes indexed ${run.index.indexed}/${run.index.total}` + (phases ? ` · phases: ${phases}` : "") +
    (run.index.error ? ` · pool: ${run.index.error}` : "");
  for (const [key, chart] of Object.entries(run.pool)) chartBox("pool-" + key, chart, document.getElementById("pool-charts"));
  for (const [key, chart] of Object.entries(run.trainer)) chartBox("trainer-" + key, chart, document.getElementById("trainer-charts"));
  const box = document.getElementById("eval-box");
  if (run.evaluations.length) {
    box.replaceChildren(evalTable(run.evaluations), el("div", { class: "charts", id: "eval-charts" }));
    delete plots["eval"];
    chartBox("eval", evalChart(run.evaluations), document.getElementById("eval-charts"));
  } else box.textContent = "no evaluation yet";
}

// ---------- episodes table ----------

const COLUMNS = [["session_id", "session", null], ["harness", "harness", "harness"], ["task_id", "task", "task"],
  ["status", "status", "status"], ["reward", "reward", "reward"], ["turns", "turns", "turns"],
  ["tokens", "tokens", "tokens"], ["versions", "versions", "version"], ["leaves", "leaves", null],
  ["split", "split", null], ["reason", "reason", null]];

function episodesQuery() {
  const hash = location.hash.split("?")[1] || "";
  return new URLSearchParams(hash);
}

function go(params) { location.hash = "#/episodes?" + params.toString(); }

function filterForm(params, facets) {
  const select = (name, values) => {
    const s = el("select", { name }, el("option", { value: "" }, name + ": any"), ...values.map((v) => el("option", { value: v }, v)));
    s.value = params.get(name) || "";
    return s;
  };
  const input = (name, placeholder) => { const i = el("input", { name, placeholder }); i.value = params.get(name) || ""; return i; };
  const form = el("form", { class: "filters", id: "filters" },
    select("harness", facets.harnesses), select("status", ["open", "completed", "failed", "aborted", "abandoned"]),
    select("split", ["train", "eval"]), select("forked", ["true", "false"]),
    input("q", "search id / task / reason"), input("min_reward", "reward ≥"), input("max_reward", "reward ≤"),
    input("version", "version"), input("group", "group key"), el("button", { type: "submit" }, "filter"));
  form.addEventListener("submit", (e) => {
    e.preventDefault();
    const next = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v) next.set(k, v);
    for (const k of ["sort", "order", "limit"]) if (params.get(k)) next.set(k, params.get(k));
    go(next);
  });
  return form;
}

async function showEpisodes() {
  const params = episodesQuery();
  const page = await api("/api/sessions?" + params.toString());
  const sort = params.get("sort") || "created", order = params.get("order") || "desc";
  const head = el("tr", {}, ...COLUMNS.map(([, label, key]) => {
    if (!key) return el("th", {}, label);
    return el("th", { class: "sortable", onclick: () => {
      const next = new URLSearchParams(params); next.set("sort", key);
      next.set("order", sort === key && order === "desc" ? "asc" : "desc"); next.delete("offset"); go(next);
    } }, label + (sort === key ? (order === "desc" ? " ▼" : " ▲") : ""));
  }));
  const rows = page.rows.map((r) => el("tr", { class: "row", "data-session": r.session_id,
    onclick: () => { location.hash = "#/episode/" + encodeURIComponent(r.session_id); } },
    ...COLUMNS.map(([field]) => el("td", {}, field === "versions"
      ? (r.min_version === null ? "–" : r.min_version === r.max_version ? r.min_version : `${r.min_version}–${r.max_version}`)
      : field === "reason" ? (r.reason || "").slice(0, 80) : fmt(r[field])))));
  const offset = page.offset, limit = page.limit;
  const move = (to) => { const next = new URLSearchParams(params); next.set("offset", Math.max(0, to)); go(next); };
  const pager = el("div", { class: "pager" },
    el("button", { onclick: () => move(offset - limit), ...(offset ? {} : { disabled: "" }) }, "← previous"),
    el("span", { id: "page-info" }, `${page.total ? offset + 1 : 0}–${Math.min(offset + limit, page.total)} of ${page.total}` +
      ` (indexed ${page.index.indexed}/${page.index.total})`),
    el("button", { onclick: () => move(offset + limit), ...(offset + limit < page.total ? {} : { disabled: "" }) }, "next →"));
  const focused = document.activeElement && document.activeElement.closest && document.activeElement.closest("#filters");
  if (focused) { document.getElementById("episodes-table").replaceWith(el("table", { id: "episodes-table" }, head, ...rows)); return; }
  view.replaceChildren(filterForm(params, page.facets), pager, el("table", { id: "episodes-table" }, head, ...rows));
}

// ---------- one episode ----------

const tip = el("div", { id: "tip" });
document.body.append(tip);

function shade(logprob) {
  // p = exp(logprob): white at p = 1, deep red as p -> 0 (a surprising sample stands out)
  const p = Math.exp(logprob), a = Math.min(1, Math.max(0, 1 - p));
  return `rgba(220, 40, 40, ${(0.08 + 0.72 * a).toFixed(2)})`;
}

function actionText(node) {
  const pre = el("pre", { class: "action" });
  node.ids.forEach((id, i) => {
    const text = node.pieces ? node.pieces[i] : `⟨${id}⟩`;
    pre.append(el("span", { class: "tok", style: `background:${shade(node.logprobs[i])}`, "data-node": node.id, "data-i": i }, text));
  });
  return pre;
}

function nodeCard(node) {
  const meta = node.kind === "act"
    ? `act #${node.id} · call ${node.call} · v${node.version} · ${node.n_tokens} tok · mean logprob ` +
      fmt(node.logprobs.reduce((a, b) => a + b, 0) / Math.max(1, node.logprobs.length)) +
      (node.step_reward !== null && node.step_reward !== undefined ? ` · step reward ${fmt(node.step_reward)}` : "")
    : `obs #${node.id} · call ${node.call} · ${node.n_tokens} tok`;
  const card = el("li", { class: "node " + node.kind, "data-node": node.id }, el("div", { class: "meta" }, meta));
  if (node.leaf) card.querySelector(".meta").append(el("span", { class: "leaf " + node.leaf }, "◀ " + node.leaf));
  if (node.kind === "act") card.append(actionText(node));
  else {
    const text = node.text ?? node.ids.join(" ");
    if (text.length > 600) card.append(el("details", {}, el("summary", {}, text.slice(0, 160) + "…"), el("pre", {}, text)));
    else card.append(el("pre", {}, text));
  }
  return card;
}

function drawBranch(start, byId, list) {
  // a chain of single children stays at one level; a fork opens one indented branch per child
  let node = byId[start];
  while (node) {
    list.append(nodeCard(node));
    if (node.children.length === 1) { node = byId[node.children[0]]; continue; }
    if (node.children.length > 1) {
      list.append(el("li", { class: "fork" }, `fork: ${node.children.length} branches`));
      for (const child of node.children) {
        const branch = el("ul", { class: "branch" });
        drawBranch(child, byId, branch);
        list.append(el("li", {}, branch));
      }
    }
    node = null;
  }
}

async function showEpisode(sessionId, rule) {
  const ep = await api(`/api/sessions/${encodeURIComponent(sessionId)}` + (rule ? `?leaf_rule=${rule}` : ""));
  const byId = Object.fromEntries(ep.nodes.map((n) => [n.id, n]));
  const s = ep.session;
  const rules = el("select", { onchange: (e) => showEpisode(sessionId, e.target.value) },
    ...["all", "drop_superseded", "main"].map((r) => el("option", { value: r }, r)));
  rules.value = ep.leaf_rule;
  const rewards = ep.rewards.map((r) => `${r.name}=${fmt(r.value)}×${fmt(r.weight)}` + (r.step === null ? "" : ` (step ${r.step})`)).join(", ");
  const tree = el("ul", { class: "tree", id: "tree" });
  for (const root of ep.roots) drawBranch(root, byId, tree);
  view.replaceChildren(
    el("h2", {}, `session ${s.session_id}`),
    el("p", {}, `task ${s.task_id} · harness ${s.harness} · `,
      el("a", { href: "#/group/" + encodeURIComponent(s.group_key), id: "group-link" }, `group ${s.group_key}`),
      ` · status ${s.status} · ${ep.calls} calls · ${ep.nodes.length} nodes · ${ep.tokens} unique tokens · outcome ${fmt(ep.outcome)}`),
    el("p", {}, "rewards: " + (rewards || "none"), " · leaf rule ", rules,
      ep.decoded ? "" : el("span", { class: "error" }, " · no tokenizer: tokens shown as ids")),
    tree);
  tree.addEventListener("mousemove", (e) => {
    const t = e.target.closest(".tok");
    if (!t) { tip.style.display = "none"; return; }
    const node = byId[t.dataset.node], i = +t.dataset.i;
    tip.textContent = `id ${node.ids[i]}\ntext ${JSON.stringify(node.pieces ? node.pieces[i] : null)}\n` +
      `logprob ${node.logprobs[i].toFixed(4)} (p ${Math.exp(node.logprobs[i]).toFixed(3)})\nversion ${node.version}`;
    Object.assign(tip.style, { display: "block", left: e.clientX + 12 + "px", top: e.clientY + 12 + "px" });
  });
  tree.addEventListener("mouseleave", () => { tip.style.display = "none"; });
}

// ---------- groups ----------

function groupsQuery() { return new URLSearchParams(location.hash.split("?")[1] || ""); }

async function showGroups() {
  const params = groupsQuery();
  const page = await api("/api/groups?" + params.toString());
  const move = (to) => { const next = new URLSearchParams(params); next.set("offset", Math.max(0, to)); location.hash = "#/groups?" + next; };
  const head = el("tr", {}, ...["group", "task", "harness", "split", "episodes", "ended", "rewarded", "reward mean [min, max]"]
    .map((h) => el("th", {}, h)));
  const rows = page.rows.map((g) => el("tr", { class: "row", "data-group": g.group_key,
    onclick: () => { location.hash = "#/group/" + encodeURIComponent(g.group_key); } },
    el("td", {}, g.group_key), el("td", {}, g.task_id), el("td", {}, g.harness), el("td", {}, g.split),
    el("td", {}, g.episodes), el("td", {}, g.ended), el("td", {}, g.rewarded),
    el("td", {}, g.reward_mean === null ? "–" : `${fmt(g.reward_mean)} [${fmt(g.reward_min)}, ${fmt(g.reward_max)}]`)));
  const { offset, limit, total } = page;
  view.replaceChildren(el("div", { class: "pager" },
    el("button", { onclick: () => move(offset - limit), ...(offset ? {} : { disabled: "" }) }, "← previous"),
    el("span", {}, `${total ? offset + 1 : 0}–${Math.min(offset + limit, total)} of ${total} groups`),
    el("button", { onclick: () => move(offset + limit), ...(offset + limit < total ? {} : { disabled: "" }) }, "next →")),
    el("table", { id: "groups-table" }, head, ...rows));
}

function advColor(a) {
  if (a === null || a === undefined) return "transparent";
  const k = Math.min(1, Math.abs(a) / 2);  // |A| = 2 (two standard deviations under GRPO) is full colour
  return a >= 0 ? `rgba(40, 160, 60, ${(0.1 + 0.6 * k).toFixed(2)})` : `rgba(220, 40, 40, ${(0.1 + 0.6 * k).toFixed(2)})`;
}

function groupCard(c) {
  const steps = el("table", { class: "steps" }, el("tr", {}, el("th", {}, "traj"), el("th", {}, "step"),
    el("th", {}, "call"), el("th", {}, "step r"), el("th", {}, "advantage")),
    ...c.steps.map((s) => el("tr", {}, el("td", {}, s.trajectory), el("td", {}, s.position), el("td", {}, s.call),
      el("td", {}, fmt(s.step_reward)), el("td", { class: "adv", style: `background:${advColor(s.advantage)}` }, fmt(s.advantage)))));
  const advs = c.steps.map((s) => s.advantage).filter((a) => a !== null);
  const same = advs.length && advs.every((a) => a === advs[0]);
  return el("div", { class: "group-card", "data-session": c.session_id },
    el("a", { href: "#/episode/" + encodeURIComponent(c.session_id) }, c.session_id),
    el("div", { class: "big", style: `background:${advColor(same ? advs[0] : null)}` },
      same ? `A = ${fmt(advs[0])}` : advs.length ? `A ∈ [${fmt(Math.min(...advs))}, ${fmt(Math.max(...advs))}]` : "A –"),
    el("div", {}, `reward ${fmt(c.reward)} · outcome ${fmt(c.outcome)} · ${c.status}`),
    el("div", { class: "dim" }, `${c.trajectories} ${c.trajectories === 1 ? "trajectory" : "trajectories"} · ${c.tokens} tokens`),
    c.left_out ? el("div", { class: "error" }, "left out: " + c.left_out) : steps);
}

async function showGroup(key) {
  setStatus("computing the group's advantages…");
  const g = await api("/api/groups/" + encodeURIComponent(key));
  const args = Object.entries(g.advantage_args).map(([k, v]) => `${k}=${v}`).join(", ");
  view.replaceChildren(
    el("h2", {}, `group ${g.group_key}`),
    el("p", {}, `task ${g.task_id} · harness ${g.harness} · ${g.episodes.length} episodes · outcome mean ${fmt(g.outcome_mean)}` +
      ` · std ${fmt(g.outcome_std)} · advantage ${g.advantage}${args ? ` (${args})` : ""} · leaf rule ${g.leaf_rule}`),
    el("p", { class: "dim" }, `settings: ${g.settings}` + (g.note ? ` · ${g.note}` : "")),
    g.skip ? el("p", { class: "error", id: "group-skip" }, `the trainer skips this group: ${g.skip}`) : "",
    el("div", { class: "group-cards", id: "group-cards" }, ...g.episodes.map(groupCard)));
}

// ---------- routing ----------

async function route() {
  clearTimeout(timer);
  const hash = location.hash || "#/run";
  document.getElementById("nav-run").className = hash.startsWith("#/run") ? "active" : "";
  document.getElementById("nav-episodes").className = hash.startsWith("#/episodes") ? "active" : "";
  document.getElementById("nav-groups").className = hash.startsWith("#/group") ? "active" : "";
  const one = hash.startsWith("#/episode/") || hash.startsWith("#/group/");
  try {
    if (hash.startsWith("#/episode/")) { await showEpisode(decodeURIComponent(hash.slice(10).split("?")[0])); setStatus(""); return; }
    if (hash.startsWith("#/group/")) { await showGroup(decodeURIComponent(hash.slice(8))); setStatus(""); return; }
    if (hash.startsWith("#/groups")) await showGroups();
    else if (hash.startsWith("#/episodes")) await showEpisodes();
    else await showRun();
    setStatus("live · updated " + new Date().toLocaleTimeString());
  } catch (err) {
    setStatus(String(err.message || err), true);
    if (one) view.replaceChildren(el("p", { class: "error" }, String(err.message || err)));  // polled again: a 503 passes
  }
  timer = setTimeout(route, info.poll_s * 1000);  // live: the run's files and the pool, polled
}

async function start() {
  try {
    info = await api("/api/info");
    document.getElementById("source").textContent = info.run_dir || info.pool || "";
  } catch (err) { setStatus(String(err.message || err), true); }
  window.addEventListener("hashchange", () => { if (!location.hash.startsWith("#/run")) view.replaceChildren(); route(); });
  route();
}

start();
