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
td, dd, li { overflow-wrap: anywhere; }
a:focus, button:focus, input:focus, select:focus { outline: 3px solid #48f; }
@media (max-width: 40rem) { .wide { display: none; } }
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
"""
