"use strict";
// squareq ui's page, written for it: the runs list and the start form, and one run's curves, samples, files and log,
// each read from the server's JSON every POLL_MS (the server reads the files the trainer writes).
const POLL_MS = Number(new URLSearchParams(location.search).get("poll")) || 700;  // ?poll=MS asks more or less often
const SVG = "http://www.w3.org/2000/svg";
const view = { run: null, rows: [], samplesKey: "", timer: null };

async function api(path, body) {
  const init = body === undefined ? {} : {
    method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) };
  const answer = await fetch(path, init);
  const data = await answer.json().catch(() => ({ error: answer.statusText }));
  if (!answer.ok) throw new Error(data.error || answer.statusText);
  return data;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "text") node.textContent = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(key, value);
  }
  node.append(...children.filter((c) => c !== null && c !== undefined));
  return node;
}

const $ = (id) => document.getElementById(id);
const runPath = (name) => `/api/runs/${encodeURIComponent(name)}`;

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "";
  const s = Math.round(seconds);
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

const when = (t) => (t ? new Date(t * 1000).toLocaleString() : "");
const stepText = (run) => `${run.step}/${run.total ?? "?"}`;

function say(node, text, ok) {
  node.textContent = text;
  node.classList.toggle("ok", Boolean(ok));
}

async function act(name, what, messageNode) {
  try {
    const done = await api(`${runPath(name)}/${what}`, {});
    say(messageNode, `${name}: ${done.done || `${what} queued`}`, true);
  } catch (error) {
    say(messageNode, error.message, false);
  }
}

// ---------------------------------------------------------------------------------------------- the runs list

function runRow(run) {
  const message = $("start-message");
  const actions = el("td", {},
    ["running", "starting", "queued"].includes(run.status)
      ? el("button", { class: "stop", text: "Stop", onclick: () => act(run.name, "stop", message) }) : null,
    run.resumable ? el("button", { class: "resume", text: "Resume", onclick: () => act(run.name, "resume", message) })
      : null);
  const config = run.config ? el("details", {}, el("summary", { text: "config.toml" }), el("pre", { text: run.config }))
    : el("span", { text: run.message || "" });
  return el("tr", { "data-run": run.name, "data-status": run.status },
    el("td", {}, el("a", { href: `#run/${encodeURIComponent(run.name)}`, text: run.name })),
    el("td", {}, el("span", { class: `status ${run.status}`, text: run.status, title: run.message || "" })),
    el("td", { class: "step", text: stepText(run) }), el("td", { text: duration(run.eta_s) }),
    el("td", { text: when(run.started) }), el("td", {}, config), actions);
}

async function refreshList() {
  const data = await api("/api/runs");
  $("where").textContent = `${data.runs_folder} on ${data.host}; the page's runs take turns on: ${data.lanes.join(", ")}`;
  $("runs").tBodies[0].replaceChildren(...data.runs.map(runRow));
  $("runs-empty").hidden = data.runs.length > 0;
}

async function loadStartForm() {
  const options = await api("/api/start");
  $("example").append(...options.examples.map((name) => el("option", { value: name, text: `examples/${name}` })));
  $("data-root").replaceChildren(...options.data_roots.map((root) => el("option", { value: root.index,
    text: root.path })));
  const folders = () => {
    const root = options.data_roots[Number($("data-root").value)] || { folders: [] };
    $("data-folders").replaceChildren(...root.folders.map((f) => el("option", { value: f })));
  };
  $("data-root").addEventListener("change", folders);
  folders();
  $("example").addEventListener("change", () => { $("upload-label").hidden = Boolean($("example").value); });
}

async function submitStart(event) {
  event.preventDefault();
  const file = $("upload").files[0];
  const body = { example: $("example").value || null, slab: $("slab").value, data_root: Number($("data-root").value),
    data: $("data").value, output: $("output").value };
  if (!body.example) {
    if (!file) return say($("start-message"), "pick an example config or a TOML file to upload.", false);
    body.config_text = await file.text();
    body.config_name = file.name;
  }
  try {
    const answer = await api("/api/start", body);
    say($("start-message"), `${answer.job.run} is queued.`, true);
    await refreshList();
  } catch (error) {
    say($("start-message"), error.message, false);
  }
}

// ---------------------------------------------------------------------------------------------- one run's curves

function trailingMean(points) {
  const window = Math.max(1, Math.floor(points.length / 10));
  let sum = 0;
  return points.map(([x, y], i) => {
    sum += y - (i >= window ? points[i - window][1] : 0);
    return [x, sum / Math.min(i + 1, window)];
  });
}

const pick = (rows, key) => rows.filter((r) => typeof r[key] === "number").map((r) => [r.step, r[key]]);

const CHARTS = [
  { id: "loss", title: "loss", series: (rows) => {
    const loss = pick(rows, "loss");
    return [{ name: "loss", color: "#a3acb7", points: loss },
      { name: "trailing mean", color: "#1e5ac8", points: trailingMean(loss) }];
  } },
  { id: "lr", title: "learning rate", series: (rows) => [{ color: "#7b3fb5", points: pick(rows, "lr") }] },
  { id: "validation", title: "validation loss", none: "no validation (validation_split or validation_data)",
    series: (rows, held) => [{ color: "#d2501e", points: pick(held, "val_loss") }] },
  { id: "vram", title: "peak VRAM (GB)", none: "not recorded: no CUDA GPU",
    series: (rows) => [{ color: "#1d8a4a", points: pick(rows, "peak_reserved_GB") }] },
  { id: "host", title: "host memory (GB)", series: (rows) => [{ color: "#0d7c8c", points: pick(rows, "host_GB") }] },
  { id: "slots", title: "ring slots", series: (rows) => [{ color: "#6b5b2a", points: pick(rows, "ring_slots") }] },
  { id: "wait", title: "copy wait (s)", none: "not recorded: no CUDA GPU",
    series: (rows) => [{ color: "#b5363f", points: pick(rows, "copy_wait_s") }] },
];

function svgNode(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  return node;
}

function lineChart(svg, series) {
  const all = series.flatMap((s) => s.points);
  const [w, h, left, bottom] = [330, 160, 48, 16];
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.replaceChildren();
  if (!all.length) return;
  let [x0, x1] = [Math.min(...all.map((p) => p[0])), Math.max(...all.map((p) => p[0]))];
  let [y0, y1] = [Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1]))];
  if (x1 === x0) x1 = x0 + 1;
  if (y1 === y0) { y0 -= Math.abs(y0) * 0.05 || 0.5; y1 += Math.abs(y1) * 0.05 || 0.5; }
  const X = (x) => left + ((x - x0) / (x1 - x0)) * (w - left - 6);
  const Y = (y) => 6 + (1 - (y - y0) / (y1 - y0)) * (h - bottom - 12);
  svg.append(svgNode("line", { class: "axis", x1: left, y1: h - bottom, x2: w - 4, y2: h - bottom }),
    svgNode("line", { class: "axis", x1: left, y1: 4, x2: left, y2: h - bottom }));
  const label = (x, y, text, anchor) => {
    const node = svgNode("text", { class: "label", x, y, "text-anchor": anchor });
    node.textContent = text;
    svg.append(node);
  };
  const short = (v) => (Math.abs(v) >= 1e-2 && Math.abs(v) < 1e4 ? v.toPrecision(3) : v.toExponential(1));
  label(left - 4, 12, short(y1), "end");
  label(left - 4, h - bottom, short(y0), "end");
  label(left, h - 3, `step ${x0}`, "start");
  label(w - 4, h - 3, `${x1}`, "end");
  for (const s of series) {
    const points = s.points.map(([x, y]) => `${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
    svg.append(svgNode("polyline", { points, fill: "none", stroke: s.color, "stroke-width": 1.6 }));
    if (s.points.length === 1) {
      const [x, y] = s.points[0];
      svg.append(svgNode("circle", { cx: X(x), cy: Y(y), r: 2.5, fill: s.color }));
    }
  }
}

function drawCharts(rows, held) {
  for (const chart of CHARTS) {
    let box = $(`chart-${chart.id}`);
    if (!box) {
      box = el("div", { class: "chart", id: `chart-${chart.id}` }, el("h3", { text: chart.title }),
        svgNode("svg", { role: "img", "aria-label": chart.title }), el("p", { class: "none" }),
        el("div", { class: "key" }));
      $("charts").append(box);
    }
    const series = chart.series(rows, held);
    const svg = box.querySelector("svg");
    lineChart(svg, series);
    const count = series[0].points.length;
    svg.dataset.points = count;
    svg.style.display = count ? "" : "none";
    box.querySelector(".none").textContent = count ? "" : (chart.none || "no steps yet");
    const last = count ? Number(series[0].points[count - 1][1].toPrecision(4)) : null;
    box.querySelector(".key").textContent = count ? `${count} steps, last ${last}` +
      (series.length > 1 ? ` (${series.map((s) => s.name).join(", then ")})` : "") : "";
  }
}

// ---------------------------------------------------------------------------------------------- one run's page

function drawSamples(samples, prompts) {
  const key = samples.map((s) => s.url).join("|");
  $("samples-empty").hidden = samples.length > 0;
  if (key === view.samplesKey) return;  // unchanged: the images stay as they are, without a reload
  view.samplesKey = key;
  const columns = Math.max(prompts.length, ...samples.map((s) => s.prompt + 1), 0);
  const head = el("tr", {}, el("th", { text: "step" }),
    ...Array.from({ length: columns }, (_, i) => el("th", { text: prompts[i] || `prompt ${i + 1}` })));
  $("samples").tHead.replaceChildren(samples.length ? head : "");
  const steps = [...new Set(samples.map((s) => s.step))];
  $("samples").tBodies[0].replaceChildren(...steps.map((step) => el("tr", { "data-step": step },
    el("th", { text: String(step) }), ...Array.from({ length: columns }, (_, i) => {
      const found = samples.find((s) => s.step === step && s.prompt === i);
      return el("td", {}, found ? el("a", { href: found.url, target: "_blank" },
        el("img", { src: found.url, alt: `step ${step}, ${prompts[i] || `prompt ${i + 1}`}` })) : null);
    }))));
}

async function refreshMetrics(name) {
  const since = view.rows.length ? view.rows[view.rows.length - 1].step : 0;
  const fresh = await api(`${runPath(name)}/metrics?since=${since}`);
  if (view.rows.length + fresh.rows.length === fresh.count) view.rows.push(...fresh.rows);
  else view.rows = (await api(`${runPath(name)}/metrics?since=0`)).rows;  // a resume rewrote the file
}

async function refreshRun(name) {
  const run = await api(runPath(name));
  $("run-name").textContent = run.name;
  $("run-status").textContent = run.status;
  $("run-status").className = `status ${run.status}`;
  $("run-progress").textContent = `step ${stepText(run)}` + (run.eta_s !== null ? `, about ${duration(run.eta_s)} left`
    : "") + (run.checkpoint ? `; last checkpoint ${run.checkpoint}` : "");
  $("run-message").textContent = run.message || "";
  $("stop").hidden = !["running", "starting", "queued"].includes(run.status);
  $("resume").hidden = !run.resumable;
  await refreshMetrics(name);
  drawCharts(view.rows, run.validation);
  drawSamples(run.samples, run.prompts);
  $("files").replaceChildren(...run.files.map((f) => el("li", {}, `${f.kind}: `,
    el("a", { href: f.url, text: f.name }))));
  const log = $("log");
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = run.log.join("\n");
  if (atEnd) log.scrollTop = log.scrollHeight;
  $("config").textContent = run.config || "";
}

// ---------------------------------------------------------------------------------------------- views and polling

function route() {
  const match = location.hash.match(/^#run\/(.+)$/);
  const name = match ? decodeURIComponent(match[1]) : null;
  if (name !== view.run) Object.assign(view, { run: name, rows: [], samplesKey: "" });
  if (!name) $("charts").replaceChildren();
  $("list-view").hidden = Boolean(name);
  $("run-view").hidden = !name;
  poll();
}

async function poll() {
  clearTimeout(view.timer);
  try {
    if (view.run) await refreshRun(view.run);
    else await refreshList();
  } catch (error) {
    say(view.run ? $("action-message") : $("start-message"), error.message, false);
  }
  view.timer = setTimeout(poll, POLL_MS);
}

window.addEventListener("DOMContentLoaded", () => {
  $("start-form").addEventListener("submit", submitStart);
  $("stop").addEventListener("click", () => act(view.run, "stop", $("action-message")));
  $("resume").addEventListener("click", () => act(view.run, "resume", $("action-message")));
  window.addEventListener("hashchange", route);
  loadStartForm().catch((error) => say($("start-message"), error.message, false));
  route();
});
