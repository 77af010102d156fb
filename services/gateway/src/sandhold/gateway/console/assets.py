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
let signedOut = false;
function showSignedOut() {
  signedOut = true;
  for (const live of document.querySelectorAll("[role=status]")) {
    live.textContent = "Signed out (the session ended or its token was revoked): sign in again.";
  }
}
// The forms a block offers, for a block redrawn only when they change (what is
// typed into a form is not wiped by a refresh that changes nothing).
const offered = (root) => Array.from(root.querySelectorAll("form[action]"))
  .map((f) => f.getAttribute("action")).join(" ");
async function refreshBlock(block) {
  const answer = await fetch(block.dataset.refresh, {credentials: "same-origin"});
  if (answer.redirected && new URL(answer.url).pathname === "/sign-in") return showSignedOut();
  if (!answer.ok) return;
  const html = await answer.text();
  if (block.dataset.swap === "when-forms-change") {
    const drawn = document.createElement("template");
    drawn.innerHTML = html;
    if (offered(drawn.content) === offered(block)) return;
  }
  block.innerHTML = html;
  block.querySelectorAll("time[datetime]").forEach(local);
}
// One refresh at a time, at most one a second; events that come meanwhile ask
// for one more, so the last drawing is never older than the last event.
let refreshing = false, again = false, timer = null, lastRefresh = 0;
function refresh() {
  if (signedOut) return;
  if (refreshing) { again = true; return; }
  if (timer !== null) return;
  timer = setTimeout(async () => {
    timer = null;
    refreshing = true;
    try {
      for (const block of document.querySelectorAll("[data-refresh]")) await refreshBlock(block);
    } finally {
      refreshing = false;
      lastRefresh = Date.now();
      if (again) { again = false; refresh(); }
    }
  }, Math.max(150, lastRefresh + 1000 - Date.now()));
}
for (const block of document.querySelectorAll("[data-every]")) {
  setInterval(refresh, Number(block.dataset.every) * 1000);
}
// An EventSource that comes back: the browser reconnects by itself after a
// dropped connection, but gives up on an answer that is not a stream (a gateway
// restarting, a 503); then it is opened again after the last event seen
// (`?after=`: a new EventSource sends no Last-Event-ID), unless signed out.
function follow(url, live, words, setup) {
  let last = null, source = null, done = false;
  const open = () => {
    const at = last === null ? url : url + (url.includes("?") ? "&" : "?") + "after=" + last;
    source = new EventSource(at);
    source.onopen = () => { live.textContent = words.live; if (words.reopened) refresh(); };
    source.onerror = async () => {
      if (done) return;
      live.textContent = words.lost;
      if (source.readyState !== EventSource.CLOSED) return;
      const page = await fetch(location.pathname, {credentials: "same-origin"}).catch(() => null);
      if (page !== null && page.redirected) return showSignedOut();
      setTimeout(open, 2000);
    };
    setup(source, (message) => { if (message.lastEventId) last = message.lastEventId; });
  };
  open();
  return () => { done = true; source.close(); };
}
const list = document.querySelector("[data-events]");
if (list) {
  follow(list.dataset.events, document.getElementById("live"), {
    live: "Live: new events appear as they happen.",
    lost: "Connection lost: reconnecting; what happens meanwhile is shown once back.",
  }, (source, seen) => {
    source.onmessage = (message) => {
      seen(message);
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
  });
}
// A list: fetched again when one of its rows changed, and after a reconnect
// (what changed while the connection was away).
const changes = document.querySelector("[data-changes]");
if (changes) {
  follow(changes.dataset.changes, document.getElementById("live"), {
    live: "Live: the list follows changes as they happen.",
    lost: "Connection lost: reconnecting.",
    reopened: true,
  }, (source) => { source.onmessage = () => refresh(); });
}
// A command's output: each stream's bytes decoded as they come, placed by their
// offset, so a reconnect (which resumes after its Last-Event-ID) can neither
// repeat nor skip a line; bytes the log did not keep are shown as a gap.
const out = document.querySelector("[data-output]");
if (out) {
  const live = document.getElementById("output-live");
  const decoders = {stdout: new TextDecoder(), stderr: new TextDecoder()};
  const next = {stdout: 0, stderr: 0};
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
  let stop = null;
  stop = follow(out.dataset.output, live, {
    live: "Live: output appears as the command writes it.",
    lost: "Connection lost: reconnecting; the output resumes where it stopped.",
  }, (source, seen) => {
    source.addEventListener("output", (message) => {
      seen(message);
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
      stop();
      for (const stream of ["stdout", "stderr"]) show(stream, decoders[stream].decode());
      const c = JSON.parse(message.data);
      const how = c.exit_code === null || c.exit_code === undefined
        ? "" : ", exit code " + c.exit_code;
      live.textContent = "Ended: " + c.state + how + ".";
      out.dataset.ended = c.state;
      refresh();
    });
  });
}
"""
