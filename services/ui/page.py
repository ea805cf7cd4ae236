"""The dashboard's one page: plain HTML, CSS and JavaScript, no build step and nothing fetched from
elsewhere. ``/`` shows the cluster (timeline, jobs, tenants, rounds) from ``/api/overview``;
``/job/<id>`` a job (explanation, subjobs, what their programs wrote, rounds with trace links) from
``/api/job/<id>``. Text from a job (its error, its programs' output) is always escaped. Both
poll their endpoint every second."""

from __future__ import annotations

CSS = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; background: #f6f7f9; color: #1d2330; }
header { background: #1d2330; color: #fff; padding: 10px 20px; display: flex; gap: 24px;
  align-items: baseline; }
header a { color: #fff; text-decoration: none; font-weight: 600; font-size: 18px; }
header .meta { color: #b9c0cf; }
main { padding: 12px 20px; }
section { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 10px 14px;
  margin-bottom: 14px; }
h2 { font-size: 15px; margin: 0 0 8px; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eceef2; vertical-align: top; }
th { font-weight: 600; color: #555e70; font-size: 12px; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bar { background: #eceef2; height: 10px; border-radius: 5px; position: relative; min-width: 120px; }
.bar > span { position: absolute; left: 0; top: 0; bottom: 0; border-radius: 5px; }
.bar > i { position: absolute; top: -3px; bottom: -3px; width: 2px; background: #1d2330; }
.status-done { color: #1b7a3a; } .status-failed { color: #b3261e; } .status-cancelled { color: #777; }
.won { color: #1b7a3a; font-weight: 600; } .lost { color: #8a5a00; } .muted { color: #777; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
#timeline svg { width: 100%; display: block; }
#timeline text { font-size: 11px; fill: #555e70; }
rect.subjob { stroke: #1d2330; stroke-width: 0.4; }
rect.subjob.failed { fill-opacity: 0.45; stroke-dasharray: 2 2; }
rect.subjob.running { fill-opacity: 0.75; }
.grid { display: grid; grid-template-columns: 2fr 1fr; gap: 14px; }
code { font-size: 12px; }
pre { font: 12px/1.35 ui-monospace, monospace; white-space: pre-wrap; overflow-wrap: anywhere;
  margin: 4px 0 8px; padding: 6px 8px; background: #f6f7f9; border: 1px solid #eceef2; border-radius: 4px;
  max-height: 24em; overflow: auto; }
pre.status-failed { background: #fdf3f2; border-color: #f0d0cd; }
h3 { font-size: 13px; margin: 10px 0 2px; }
#explain-summary { white-space: pre-line; }
"""

JS = r"""
const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g,
  (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
const pct = (x) => (100 * x).toFixed(1) + "%";
const clock = (t) => t ? new Date(t * 1000).toLocaleTimeString() : "";
const jobLink = (id) => id ? `<a class="job-link" href="/job/${encodeURIComponent(id)}">${esc(id)}</a>` : "";

async function getJSON(url) {
  const r = await fetch(url, {cache: "no-store"});
  if (!r.ok) throw new Error(`${url}: ${r.status}`);
  return r.json();
}

function drawTimeline(data) {
  const rows = data.slices, tl = data.timeline;
  const label = (s) => `${s.slice_id} ${s.profile} (${s.mem_mib} MiB, ${s.status})`;
  const left = 16 + 6.5 * Math.max(20, ...rows.map((s) => label(s).length)), right = 10;
  const rowH = 26, top = 6, axis = 22;
  const width = Math.max(600, $("#timeline").clientWidth || 900);
  const height = top + rows.length * rowH + axis;
  const span = Math.max(tl.end - tl.start, 1);
  const x = (t) => left + (width - left - right) * (t - tl.start) / span;
  const y = {};
  rows.forEach((s, i) => { y[s.slice_id] = top + i * rowH; });
  let svg = `<svg viewBox="0 0 ${width} ${height}" height="${height}">`;
  rows.forEach((s, i) => {
    const yy = top + i * rowH;
    svg += `<rect x="${left}" y="${yy}" width="${width - left - right}" height="${rowH - 4}"`
      + ` fill="#f1f3f6"/>`;
    svg += `<text class="slice" x="4" y="${yy + rowH / 2 + 2}">${esc(label(s))}</text>`;
  });
  for (const g of tl.segments) {
    if (!(g.slice_id in y)) continue;
    const x0 = x(g.start), w = Math.max(x(g.end) - x0, 2);
    const cls = "subjob" + (g.running ? " running" : "") + (g.status !== "ok" && !g.running ? " failed" : "");
    svg += `<rect class="${cls}" data-job="${esc(g.job_id)}" data-subjob="${esc(g.subjob_id)}"`
      + ` data-slice="${esc(g.slice_id)}" x="${x0}" y="${y[g.slice_id] + 2}" width="${w}"`
      + ` height="${rowH - 8}" fill="${g.colour}"><title>${esc(g.job_id)} (${esc(g.tenant)}): `
      + `${esc(g.subjob_id)}, units ${esc(g.units_text)}, ${esc(g.status)}</title></rect>`;
  }
  const ticks = 6;
  for (let i = 0; i <= ticks; i++) {
    const t = tl.start + span * i / ticks, xx = x(t);
    svg += `<text x="${xx - 14}" y="${height - 6}">${(t - tl.end).toFixed(span < 10 ? 1 : 0)} s</text>`;
  }
  svg += `</svg>`;
  $("#timeline").innerHTML = svg;
  $("#timeline-count").textContent = `${tl.segments.length} subjobs`;
}

function drawJobs(jobs) {
  let h = `<table><tr><th>job</th><th>tenant</th><th>state</th><th>progress</th><th>running</th>`
    + `<th>why</th></tr>`;
  for (const j of jobs) {
    h += `<tr data-job="${esc(j.job_id)}"><td><span class="swatch" style="background:${j.colour}"></span>`
      + `${jobLink(j.job_id)}</td><td>${esc(j.tenant)}</td><td class="status-${esc(j.status)}">`
      + `${esc(j.status)}</td><td><div class="bar"><span style="width:${pct(j.progress)};`
      + `background:${j.colour}"></span></div><span class="muted">${j.units_done}/${j.total_units}`
      + ` units</span></td><td class="num">${j.running}</td><td>${esc(j.summary)}`
      + `${j.deadline ? `<br><span class="muted">${esc(j.deadline)}</span>` : ""}`
      + `${j.memory ? `<br><span class="lost memory">${esc(j.memory)}</span>` : ""}</td></tr>`;
  }
  $("#jobs").innerHTML = jobs.length ? h + `</table>` : `<p class="muted">no jobs yet</p>`;
}

function drawTenants(tenants) {
  let h = `<table><tr><th>tenant</th><th>attained / target</th><th>GPU-s</th><th>jobs</th></tr>`;
  for (const t of tenants) {
    h += `<tr data-tenant="${esc(t.tenant)}"><td>${esc(t.tenant)}</td><td><div class="bar">`
      + `<span style="width:${pct(t.attained)};background:#4a7bd0"></span>`
      + `<i style="left:${pct(t.target)}" title="target"></i></div>`
      + `<span class="muted">${pct(t.attained)} of ${pct(t.target)}</span></td>`
      + `<td class="num">${t.attained_gpu_s.toFixed(1)}</td><td class="num">${t.jobs}</td></tr>`;
  }
  $("#tenants").innerHTML = h + `</table>`;
}

function verdictList(r) {
  return r.verdicts.map((v) => `<div class="${v.won ? "won" : "lost"}">${v.job_id ? jobLink(v.job_id)
    : esc(v.tenant || "agent")}: ${esc(v.reason)}</div>`).join("")
    + (r.more_verdicts ? `<div class="muted">and ${r.more_verdicts} more</div>` : "");
}

function drawRounds(rounds, target, withTrace) {
  let h = `<table><tr><th>cleared</th><th>window</th><th>policy</th><th>winner</th><th>bids</th>`
    + `<th>verdicts</th>${withTrace ? "<th>trace</th>" : ""}</tr>`;
  for (const r of rounds) {
    const trace = r.trace_url ? `<a class="trace-link" href="${esc(r.trace_url)}">trace</a>`
      : `<span class="muted">${r.trace_id ? esc(r.trace_id.slice(0, 8)) : "untraced"}</span>`;
    h += `<tr class="round"><td>${clock(r.cleared_at)}</td><td>${esc(r.pool)} / ${esc(r.slice_id)}`
      + ` (${esc(r.profile)})</td><td>${esc(r.policy)}</td><td>${jobLink(r.winner_job) || `<span `
      + `class="muted">${esc(r.note || "none")}</span>`}</td><td class="num">${r.bids}</td>`
      + `<td>${verdictList(r)}</td>${withTrace ? `<td>${trace}</td>` : ""}</tr>`;
  }
  $(target).innerHTML = rounds.length ? h + `</table>` : `<p class="muted">no rounds seen yet</p>`;
}

function drawOutput(d) {
  // What each subjob's program wrote, as text: escaped, its lines kept (<pre>).
  let h = d.output_note ? `<p class="muted">${esc(d.output_note)}</p>` : "";
  for (const o of d.output) {
    h += `<div class="subjob-output" data-subjob="${esc(o.subjob_id)}"><h3>${esc(o.subjob_id)} on `
      + `${esc(o.slice_id)}: ${esc(o.status)}, units ${esc(o.units_text)}, ${o.units_done} done</h3>`;
    if (o.error) {
      h += `<div class="muted">reason</div><pre class="status-failed reason">${esc(o.error)}</pre>`;
    }
    if (o.stdout) h += `<div class="muted">stdout</div><pre class="stdout">${esc(o.stdout)}</pre>`;
    if (o.stderr) h += `<div class="muted">stderr</div><pre class="stderr">${esc(o.stderr)}</pre>`;
    if (!o.error && !o.stdout && !o.stderr) h += `<p class="muted">no output</p>`;
    h += `</div>`;
  }
  if (!d.output.length && !d.output_note) h = `<p class="muted">no subjob has ended yet</p>`;
  $("#output").innerHTML = h;
}

async function dashboard() {
  $("#job-view").hidden = true;
  $("#dashboard").hidden = false;
  try {
    const d = await getJSON("/api/overview");
    const counts = Object.entries(d.job_counts).map(([k, v]) => `${v} ${k}`).join(", ") || "no jobs";
    const who = d.viewer && !d.viewer.operator ? `tenant ${d.viewer.tenant}'s view · ` : "";
    const policy = d.policy || "(no round yet)";
    $("#meta").textContent = `${who}${d.slices.length} slices · ${counts} · policy ${policy}`;
    drawTimeline(d);
    drawJobs(d.jobs);
    drawTenants(d.tenants);
    drawRounds(d.rounds, "#rounds", false);
    $("#error").textContent = "";
  } catch (e) {
    $("#error").textContent = String(e);
  }
}

async function jobView(id) {
  $("#dashboard").hidden = true;
  $("#job-view").hidden = false;
  try {
    const d = await getJSON(`/api/job/${encodeURIComponent(id)}`);
    const j = d.job, x = d.explanation;
    $("#meta").textContent = `job ${j.job_id}`;
    $("#job-title").innerHTML = `<span class="swatch" style="background:${j.colour}"></span>`
      + `${esc(j.job_id)} <span class="muted">(${esc(j.tenant)}, ${esc(j.workload)})</span>`;
    $("#job-state").innerHTML = `<span class="status-${esc(j.status)}">${esc(j.status)}</span> · `
      + `${j.units_done}/${j.total_units} units · <span id="subjob-tally">${esc(j.subjobs_text)}</span>`
      + ` · ${j.running} running`
      + `<div class="bar"><span style="width:${pct(j.progress)};background:${j.colour}"></span></div>`
      + (d.error ? `<pre class="status-failed" id="job-error">${esc(d.error)}</pre>` : "")
      + (j.status === "done" ? `<p>result: <code>${esc(JSON.stringify(d.result))}</code></p>` : "");
    let h = `<p id="explain-summary">${esc(x.summary)}</p>`;
    if (x.position) h += `<p>place in line: ${x.position} of ${x.waiting} waiting — ${esc(x.order)}</p>`;
    if (x.deadline) h += `<p>${esc(x.deadline)}</p>`;
    for (const n of x.notes) h += `<p class="lost">${esc(n)}</p>`;
    if (x.windows.length) {
      h += `<table><tr><th>window</th><th>outcome</th><th>why</th></tr>`;
      for (const w of x.windows) {
        h += `<tr><td>${esc(w.pool)} ${esc(w.profile)} (${w.mem_mib} MiB)</td><td class="`
          + `${w.outcome === "won" ? "won" : "lost"}">${esc(w.outcome.replace("_", " "))}</td>`
          + `<td>${esc(w.reason)}`
          + `${w.policy ? ` <span class="muted">(${esc(w.policy)})</span>` : ""}</td></tr>`;
      }
      h += `</table>`;
    }
    h += `<p class="muted">explained by the ${esc(x.by)}${x.policy ? `, policy ${esc(x.policy)}` : ""}</p>`;
    $("#explanation").innerHTML = h;
    let s = `<table><tr><th>subjob</th><th>slice</th><th>units</th><th>state</th><th>planned MiB</th>`
      + `<th>peak MiB</th><th>cap MiB</th><th>seconds</th><th>cap s</th></tr>`;
    for (const r of d.subjobs) {
      const num = (v, p) => v === null || v === undefined ? "" : v.toFixed(p);
      s += `<tr><td>${esc(r.subjob_id)}</td><td>${esc(r.slice_id)} (${esc(r.profile)})</td>`
        + `<td class="num">${esc(r.units_text)}</td><td>${esc(r.status)}</td>`
        + `<td class="num">${num(r.planned_mem_q_mib, 0)}</td><td class="num">${num(r.peak_mem_mib, 0)}</td>`
        + `<td class="num">${r.mem_cap_mib ?? ""}</td><td class="num">${num(r.duration_s, 2)}</td>`
        + `<td class="num">${num(r.time_cap_s, 1)}</td></tr>`;
    }
    $("#subjobs").innerHTML = d.subjobs.length ? s + `</table>` : `<p class="muted">no subjob yet</p>`;
    drawOutput(d);
    $("#job-rounds-count").textContent = `${d.rounds_total} rounds`
      + (d.jaeger_url ? "" : " (set SJA_JAEGER_URL for trace links)");
    drawRounds(d.rounds, "#job-rounds", true);
    $("#error").textContent = "";
  } catch (e) {
    $("#error").textContent = String(e);
  }
}

async function tick() {
  const path = decodeURIComponent(location.pathname);
  if (path.startsWith("/job/")) await jobView(path.slice(5));
  else await dashboard();
  setTimeout(tick, 1000);
}
tick();
"""

HTML = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>SJA dashboard</title>
<style>{CSS}</style>
</head>
<body>
<header><a href="/">SJA</a><span class="meta" id="meta">loading…</span>
<span class="meta status-failed" id="error"></span></header>
<main>
<div id="dashboard">
<section><h2>Slices &times; time <span class="muted" id="timeline-count"></span></h2>
<div id="timeline"></div></section>
<div class="grid">
<section><h2>Jobs</h2><div id="jobs"></div></section>
<section><h2>Tenants: attained share against target</h2><div id="tenants"></div></section>
</div>
<section><h2>Recent rounds</h2><div id="rounds"></div></section>
</div>
<div id="job-view" hidden>
<section><h2 id="job-title"></h2><div id="job-state"></div></section>
<section><h2>Why</h2><div id="explanation"></div></section>
<section><h2>Subjobs</h2><div id="subjobs"></div>
<p class="muted">units: the first and last unit, both included, and how many (0-7 (8): units 0 to 7)</p>
</section>
<section><h2>Output <span class="muted">(the end of each subjob's stdout and stderr)</span></h2>
<div id="output"></div></section>
<section><h2>Rounds <span class="muted" id="job-rounds-count"></span></h2><div id="job-rounds"></div>
</section>
</div>
</main>
<script>{JS}</script>
</body>
</html>
"""
