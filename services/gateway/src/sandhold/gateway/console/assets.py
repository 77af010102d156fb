"""The console's stylesheet and its one script, served by the gateway."""

STYLE = """\
:root { color-scheme: light dark; --line: #8884; --muted: #777; }
body { font: 15px/1.45 system-ui, sans-serif; margin: 0; }
header { display: flex; gap: 1.5rem; align-items: center; padding: .6rem 1.2rem;
         border-bottom: 1px solid var(--line); flex-wrap: wrap; }
header strong { margin-right: auto; }
main { padding: 1rem 1.2rem; max-width: 80rem; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .35rem .6rem; border-bottom: 1px solid var(--line); }
th { font-weight: 600; }
.muted { color: var(--muted); }
.error { border: 2px solid #c33; padding: .6rem .9rem; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: .3rem 1rem; }
dt { font-weight: 600; }
dd, li { overflow-wrap: anywhere; }
td { overflow-wrap: break-word; }
a:focus, button:focus, input:focus, select:focus { outline: 3px solid #48f; }
@media (max-width: 40rem) { .wide { display: none; } }
.action { display: inline-flex; gap: .4rem; align-items: center; flex-wrap: wrap;
          margin: 0 1.2rem .6rem 0; }
.notice { border-left: 4px solid #48f; padding: .3rem .8rem; }
pre { white-space: pre-wrap; overflow-wrap: anywhere; border: 1px solid var(--line);
      padding: .6rem; min-height: 3rem; max-height: 60vh; overflow: auto; }
.stderr { color: #c33; text-decoration: underline dotted; }
.chart { margin: 0 0 .6rem; }
.chart svg { max-width: 100%; height: auto; }
figcaption { font-size: .85rem; color: var(--muted); }
.skip { position: absolute; left: -999rem; }
.skip:focus { left: 1rem; top: .5rem; background: Canvas; padding: .3rem .6rem; }
"""

# The pages' one script: times in the viewer's zone; a page's events as they
# come (EventSource resumes after its Last-Event-ID by itself, so a dropped
# connection shows what it missed, each event once), with the page's
# `data-refresh` blocks fetched again after them.
SCRIPT = """\
"use strict";
function local(t) {
  const when = new Date(t.dateTime);
  t.title = when.toISOString().replace("T", " ").slice(0, 19) + " UTC";
  t.textContent = when.toLocaleString();
}
document.querySelectorAll("time[datetime]").forEach(local);
function summary(fields) {
  return Object.entries(fields || {})
    .filter(([k, v]) => k !== "type" && v !== null && typeof v !== "object")
    .map(([k, v]) => k + "=" + String(v).slice(0, 80)).join(" ");
}
let pending = null;
function refresh() {
  if (pending !== null) return;
  pending = setTimeout(async () => {
    pending = null;
    for (const block of document.querySelectorAll("[data-refresh]")) {
      const answer = await fetch(block.dataset.refresh, {credentials: "same-origin"});
      if (answer.ok) {
        block.innerHTML = await answer.text();
        block.querySelectorAll("time[datetime]").forEach(local);
      }
    }
  }, 150);
}
for (const block of document.querySelectorAll("[data-every]")) {
  setInterval(refresh, Number(block.dataset.every) * 1000);
}
const list = document.querySelector("[data-events]");
if (list) {
  const live = document.getElementById("live");
  const source = new EventSource(list.dataset.events);
  source.onopen = () => { live.textContent = "Live: new events appear as they happen."; };
  source.onerror = () => {
    live.textContent = "Connection lost: reconnecting; what happens meanwhile is shown once back.";
  };
  source.onmessage = (message) => {
    const e = JSON.parse(message.data);
    if (document.getElementById("ev-" + e.seq)) return;
    const item = document.createElement("li");
    item.id = "ev-" + e.seq;
    const t = document.createElement("time");
    t.dateTime = new Date(e.time * 1000).toISOString();
    local(t);
    const kind = document.createElement("strong");
    kind.textContent = e.type;
    item.append(t, " ", kind, " ", summary(e.event), " (" + e.actor + ")");
    list.append(item);
    refresh();
  };
}
// A list: fetched again when one of its rows changed.
const changes = document.querySelector("[data-changes]");
if (changes) {
  const live = document.getElementById("live");
  const source = new EventSource(changes.dataset.changes);
  source.onopen = () => {
    live.textContent = "Live: the list follows changes as they happen.";
    refresh();  // what changed while the connection was away
  };
  source.onerror = () => { live.textContent = "Connection lost: reconnecting."; };
  source.onmessage = () => refresh();
}
// A command's output: each stream's bytes decoded as they come, placed by their
// offset, so a reconnect (which resumes after its Last-Event-ID) can neither
// repeat nor skip a line; bytes the log did not keep are shown as a gap.
const out = document.querySelector("[data-output]");
if (out) {
  const live = document.getElementById("output-live");
  const decoders = {stdout: new TextDecoder(), stderr: new TextDecoder()};
  const next = {stdout: 0, stderr: 0};
  let ended = false;
  const show = (stream, text) => {
    if (!text) return;
    if (stream === "stderr") {
      const span = document.createElement("span");
      span.className = "stderr";
      span.textContent = text;
      out.append(span);
    } else {
      out.append(document.createTextNode(text));
    }
  };
  const source = new EventSource(out.dataset.output);
  source.onopen = () => { live.textContent = "Live: output appears as the command writes it."; };
  source.onerror = () => {
    if (ended) return;
    live.textContent = "Connection lost: reconnecting; the output resumes where it stopped.";
  };
  source.addEventListener("output", (message) => {
    const chunk = JSON.parse(message.data);
    const raw = atob(chunk.data);
    const bytes = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
    const have = next[chunk.stream];
    if (chunk.offset + bytes.length <= have) return;
    let part = bytes;
    if (chunk.offset > have) {
      show(chunk.stream, "[" + (chunk.offset - have) + " bytes not kept]\\n");
    } else {
      part = bytes.subarray(have - chunk.offset);
    }
    next[chunk.stream] = chunk.offset + bytes.length;
    show(chunk.stream, decoders[chunk.stream].decode(part, {stream: true}));
  });
  source.addEventListener("end", (message) => {
    ended = true;
    source.close();
    for (const stream of ["stdout", "stderr"]) show(stream, decoders[stream].decode());
    const c = JSON.parse(message.data);
    const how = c.exit_code === null || c.exit_code === undefined
      ? "" : ", exit code " + c.exit_code;
    live.textContent = "Ended: " + c.state + how + ".";
    out.dataset.ended = c.state;
    refresh();
  });
}
"""
