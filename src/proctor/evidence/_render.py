"""The report for people: Markdown and printable HTML, from the summary document.

Charts (calls and denials over time) are drawn with matplotlib's Agg backend,
PNG, embedded in the HTML as data URIs so the file stands alone.
"""

from __future__ import annotations

import base64
import html
import io
from typing import Any

_MAX_ROWS = 200  # per table: a report is read, the pack holds everything


def _bucketed(timeline: dict[str, list[int]]) -> tuple[list[str], list[int], list[int]]:
    """Per-minute counts regrouped so that a chart has at most ~60 bars."""
    minutes = sorted(timeline)
    if not minutes:
        return [], [], []
    width = 16 if len(minutes) <= 60 else 13 if len(minutes) <= 60 * 60 else 10
    labels: list[str] = []
    calls: list[int] = []
    denials: list[int] = []
    for m in minutes:
        key = m[:width]
        if not labels or labels[-1] != key:
            labels.append(key)
            calls.append(0)
            denials.append(0)
        calls[-1] += timeline[m][0]
        denials[-1] += timeline[m][1]
    return labels, calls, denials


def chart_png(summary: dict[str, Any]) -> bytes | None:
    labels, calls, denials = _bucketed(summary.get("timeline", {}))
    if not labels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3), dpi=100)
    try:
        xs = list(range(len(labels)))
        ax.bar(
            xs,
            [c - d for c, d in zip(calls, denials, strict=True)],
            label="allowed",
            color="#4c78a8",
        )
        ax.bar(
            xs,
            denials,
            bottom=[c - d for c, d in zip(calls, denials, strict=True)],
            label="denied",
            color="#e45756",
        )
        step = max(1, len(labels) // 8)
        ax.set_xticks(xs[::step])
        ax.set_xticklabels([lbl[5:].replace("T", " ") for lbl in labels[::step]], fontsize=7)
        ax.set_ylabel("data-plane calls")
        ax.set_title("Calls and denials over time (UTC)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", metadata={"Software": None})
        return buf.getvalue()
    finally:
        plt.close(fig)


def _links(seqs: list[int]) -> str:
    return ", ".join(f"[{s}](#ev-{s})" for s in seqs)


def _hlinks(seqs: list[int]) -> str:
    return ", ".join(f'<a href="#ev-{s}">{s}</a>' for s in seqs)


def _md_cell(value: Any) -> str:
    return str(value if value is not None else "").replace("|", "\\|").replace("\n", " ")


def _starter(r: dict[str, Any]) -> str:
    """Who started a run, and as what: ``acme/dev (user)``, ``local-operator:root@h
    (operator)``, or the runtime's supervisor (for a service or schedule)."""
    kind = r.get("started_by_type")
    return f"{r.get('started_by')} ({kind})" if kind else str(r.get("started_by"))


def render_markdown(
    meta: dict[str, Any], s: dict[str, Any], appendix: list[dict[str, Any]], chart: str | None
) -> str:
    out = [
        f"# Evidence report: tenant {meta['tenant']}",
        "",
        f"Period {meta['from']} to {meta['to']} (UTC); log `{meta['origin']}`; events "
        f"{s['first_seq']} to {s['last_seq']} ({s['events']} events); end checkpoint size "
        f"{meta['end_size']}. Verify offline: `proctor evidence verify PACK.zip --key '<vkey>'`.",
        "",
        f"Decisions: {s['decisions'].get('allow', 0)} allowed, {s['decisions'].get('deny', 0)} "
        f"denied; {s['production_runs']} production run(s).",
        "",
    ]
    if chart:
        out += [f"![Calls and denials over time]({chart})", ""]
    out += [
        "## Controls",
        "",
        "| control | what the evidence shows | events | examples |",
        "|---|---|---|---|",
    ]
    for c in s["controls"]:
        out.append(
            f"| {c['title']} | {_md_cell(c['statement'])} | {c['count']} | {_links(c['events'])} |"
        )
    out += [
        "",
        "## Runs and their approval chains",
        "",
        "| run | deployment | env | started | started by | status | author | approved by (when) "
        "| calls | denied |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["runs"][:_MAX_ROWS]:
        chain = (
            "; ".join(
                f"{a.get('principal')} ({a.get('at')}, [{a.get('seq')}](#ev-{a.get('seq')}))"
                for a in r["approval_chain"]
            )
            or "—"
        )
        deployment = str(r["deployment"])
        if r.get("deployed_by"):
            deployment += f", deployed by {r['deployed_by']} ([{r['deployed_seq']}]"
            deployment += f"(#ev-{r['deployed_seq']}))"
        out.append(
            f"| [{r['run']}](#ev-{r['start_seq']}) | {_md_cell(deployment)} | "
            f"{r['environment']} | {r['started_at']} | {_md_cell(_starter(r))} | {r['status']} | "
            f"{r['author']} | {_md_cell(chain)} | {r['calls']} | {r['denied']} |"
        )
    out += ["", "## Denied calls by reason", "", "| reason | count | events |", "|---|---|---|"]
    for d in s["denied"][:_MAX_ROWS]:
        out.append(f"| {_md_cell(d['reason'])} | {d['count']} | {_links(d['events'])} |")
    out += [
        "",
        "## Data accessed per dataset and column",
        "",
        "| dataset | column | calls |",
        "|---|---|---|",
    ]
    for ds, cols in s["data"].items():
        for col, n in cols.items():
            out.append(f"| {ds} | {col} | {n} |")
    out += [
        "",
        "## Hosts reached per subprocessor",
        "",
        "| subprocessor | location | purpose | hosts registered | reached (requests) |",
        "|---|---|---|---|---|",
    ]
    for sp in s["subprocessors"]:
        reached = ", ".join(f"{h} ({n})" for h, n in sp["reached"].items()) or "—"
        out.append(
            f"| {sp['name']} | {_md_cell(sp['location'])} | {_md_cell(sp['purpose'])} | "
            f"{', '.join(sp['hosts'])} | {reached} |"
        )
    if s["uncovered_hosts"]:
        out += [
            "",
            "Hosts reached that no registered subprocessor covers: "
            + ", ".join(f"{h} ({n})" for h, n in s["uncovered_hosts"].items()),
        ]
    out += ["", "## Events cited", ""]
    for ev in appendix:
        out.append(
            f'- <a id="ev-{ev["seq"]}"></a>**{ev["seq"]}** {ev["time"]} `{ev["action"]}` '
            f"{_md_cell(ev['resource'])} **{ev['decision']}** by {ev['actor']['id']}: "
            f"{_md_cell(ev['reason'])}"
        )
    return "\n".join(out) + "\n"


_CSS = """
body { font: 11pt/1.4 system-ui, sans-serif; margin: 2em; color: #111; }
table { border-collapse: collapse; width: 100%; margin: .5em 0 1.5em; font-size: 9pt; }
th, td { border: 1px solid #bbb; padding: 3px 5px; text-align: left; vertical-align: top; }
th { background: #eee; }
td { overflow-wrap: anywhere; }
.deny { color: #b00; font-weight: bold; }
img { max-width: 100%; }
@media print {
  body { margin: 0; font-size: 9pt; }
  h2 { page-break-before: auto; page-break-after: avoid; }
  tr, img { page-break-inside: avoid; }
  thead { display: table-header-group; }
  a { color: inherit; text-decoration: none; }
}
"""


def render_html(
    meta: dict[str, Any], s: dict[str, Any], appendix: list[dict[str, Any]], png: bytes | None
) -> str:
    e = html.escape

    def table(head: list[str], rows: list[list[str]]) -> str:
        h = "".join(f"<th>{e(x)}</th>" for x in head)
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
        return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Evidence report: {e(meta['tenant'])}</title><style>{_CSS}</style></head><body>",
        f"<h1>Evidence report: tenant {e(meta['tenant'])}</h1>",
        f"<p>Period {e(meta['from'])} to {e(meta['to'])} (UTC); log <code>{e(meta['origin'])}"
        f"</code>; events {s['first_seq']} to {s['last_seq']} ({s['events']} events); end "
        f"checkpoint size {meta['end_size']}.</p>",
        f"<p>Decisions: {s['decisions'].get('allow', 0)} allowed, "
        f"<span class='deny'>{s['decisions'].get('deny', 0)} denied</span>; "
        f"{s['production_runs']} production run(s).</p>",
    ]
    if png:
        uri = "data:image/png;base64," + base64.b64encode(png).decode()
        parts.append(f"<img alt='Calls and denials over time' src='{uri}'>")
    parts.append("<h2>Controls</h2>")
    parts.append(
        table(
            ["control", "what the evidence shows", "events", "examples"],
            [
                [e(c["title"]), e(c["statement"]), str(c["count"]), _hlinks(c["events"])]
                for c in s["controls"]
            ],
        )
    )
    parts.append("<h2>Runs and their approval chains</h2>")
    rows = []
    for r in s["runs"][:_MAX_ROWS]:
        chain = (
            "<br>".join(
                f"{e(str(a.get('principal')))} at {e(str(a.get('at')))} "
                f"(<a href='#ev-{a.get('seq')}'>{a.get('seq')}</a>)"
                for a in r["approval_chain"]
            )
            or "—"
        )
        deployment = e(str(r["deployment"]))
        if r.get("deployed_by"):
            deployment += (
                f"<br>deployed by {e(str(r['deployed_by']))} "
                f"(<a href='#ev-{r['deployed_seq']}'>{r['deployed_seq']}</a>)"
            )
        rows.append(
            [
                f"<a href='#ev-{r['start_seq']}'>{e(r['run'])}</a>",
                deployment,
                e(str(r["environment"])),
                e(r["started_at"]),
                e(_starter(r)),
                e(str(r["status"])),
                e(str(r["author"])),
                chain,
                str(r["calls"]),
                str(r["denied"]),
            ]
        )
    parts.append(
        table(
            [
                "run",
                "deployment",
                "env",
                "started",
                "started by",
                "status",
                "author",
                "approved by",
                "calls",
                "denied",
            ],
            rows,
        )
    )
    parts.append("<h2>Denied calls by reason</h2>")
    parts.append(
        table(
            ["reason", "count", "events"],
            [
                [e(d["reason"]), str(d["count"]), _hlinks(d["events"])]
                for d in s["denied"][:_MAX_ROWS]
            ],
        )
    )
    parts.append("<h2>Data accessed per dataset and column</h2>")
    parts.append(
        table(
            ["dataset", "column", "calls"],
            [[e(ds), e(col), str(n)] for ds, cols in s["data"].items() for col, n in cols.items()],
        )
    )
    parts.append("<h2>Hosts reached per subprocessor</h2>")
    parts.append(
        table(
            ["subprocessor", "location", "purpose", "hosts", "reached"],
            [
                [
                    e(str(sp["name"])),
                    e(str(sp["location"])),
                    e(str(sp["purpose"])),
                    e(", ".join(sp["hosts"])),
                    e(", ".join(f"{h} ({n})" for h, n in sp["reached"].items()) or "—"),
                ]
                for sp in s["subprocessors"]
            ],
        )
    )
    if s["uncovered_hosts"]:
        parts.append(
            "<p class='deny'>Hosts reached that no registered subprocessor covers: "
            + e(", ".join(f"{h} ({n})" for h, n in s["uncovered_hosts"].items()))
            + "</p>"
        )
    parts.append("<h2>Events cited</h2>")
    parts.append(
        table(
            ["seq", "time", "actor", "action", "resource", "decision", "reason"],
            [
                [
                    f"<a id='ev-{ev['seq']}'></a>{ev['seq']}",
                    e(ev["time"]),
                    e(ev["actor"]["id"]),
                    e(ev["action"]),
                    e(ev["resource"]),
                    f"<span class='{'deny' if ev['decision'] == 'deny' else ''}'>"
                    f"{e(ev['decision'])}</span>",
                    e(ev["reason"]),
                ]
                for ev in appendix
            ],
        )
    )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def cited_seqs(s: dict[str, Any]) -> set[int]:
    seqs: set[int] = set()
    for c in s["controls"]:
        seqs.update(c["events"])
    for d in s["denied"][:_MAX_ROWS]:
        seqs.update(d["events"])
    for r in s["runs"][:_MAX_ROWS]:
        seqs.add(int(r["start_seq"]))
        if r.get("deployed_seq") is not None:
            seqs.add(int(r["deployed_seq"]))
        seqs.update(int(a["seq"]) for a in r["approval_chain"] if a.get("seq") is not None)
    return seqs
