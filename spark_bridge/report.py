"""An Analysis as a terminal table and as a self-contained HTML page with charts.

Both render what `analysis.analyze` collected; nothing here talks to
Spark. The HTML page embeds its charts as PNG data URIs (matplotlib's Agg
backend, no display needed) so it can be mailed or attached to a ticket
as one file.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from spark_bridge.analysis import (
    AGE_BUCKETS,
    DUE_BUCKETS,
    PERCENTILES,
    SIZE_BUCKETS,
    STATES,
    Analysis,
    LogWindow,
)

__all__ = ["format_age", "format_bytes", "load_charting", "render_html", "render_text", "window_span", "write_html"]


def format_age(seconds: float | None) -> str:
    """Seconds as the two largest units: 3d 4h, 2h 5m, 4m 10s, 12.5s."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    out: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if seconds >= size or out:
            value, seconds = divmod(seconds, size)
            out.append(f"{int(value)}{unit}")
        if len(out) == 2:
            break
    return " ".join(out)


def format_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _queue_name(row: dict[str, Any]) -> str:
    return row["topic"] if row["channel"] is None else f"{row['topic']}/{row['channel']}"


def _time(value: datetime | None) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


# How each state is named in the reports, and its colour in the charts.
_STATE_LABELS = {"queued": "queued", "in_flight": "in flight", "deferred": "deferred"}
_STATE_COLORS = {"queued": "tab:blue", "in_flight": "tab:orange", "deferred": "tab:purple"}


def _states_line(analysis: Analysis) -> str:
    """`N queued, N in flight, N deferred` over every queue."""
    return ", ".join(f"{analysis.state_total(s):,} {_STATE_LABELS[s]}" for s in STATES)


def _source_line(analysis: Analysis) -> str:
    """Where the rows come from, and so what they can hold."""
    m = analysis.manifest
    if m is None:
        return _NOT_IN_LOG
    if m.source == "broker":
        how = ", ".join(x for x in (m.backend, "durable" if m.durable else None) if x)
        return f"taken by the broker{f' ({how})' if how else ''}: everything it held"
    return ("a copy of a store's files: messages a running broker held in memory, in flight or "
            "deferred are not in it")


def _left_out_lines(analysis: Analysis) -> list[str]:
    """One `left out (<reason>): queue (counts), ...` line per reason; none if nothing was."""
    by_reason: dict[str, list[str]] = defaultdict(list)
    for q in analysis.left_out:
        by_reason[q.get("reason", "unknown")].append(
            f"{_queue_name(q)} ({q.get('depth', 0):,} queued, {q.get('in_flight_count', 0):,} "
            f"in flight, {q.get('deferred_count', 0):,} deferred)")
    return [f"left out ({reason}): " + ", ".join(names) for reason, names in by_reason.items()]


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Sequence[bool]) -> list[str]:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if r else v.ljust(w)
                         for v, w, r in zip(values, widths, right, strict=True)).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells]


_TAGS = [f"p{round(p * 100)}" for p in PERCENTILES]
# How the group of bodies without the JSON field (json_value null) is shown.
_NO_JSON_VALUE = "(not JSON / no field)"


def _summary_rows(analysis: Analysis) -> tuple[list[str], list[list[Any]], list[bool]]:
    if analysis.window is not None:
        return _window_summary_rows(analysis)
    headers = ["queue", "kind", "backlog", *[_STATE_LABELS[s] for s in STATES], "in flight %",
               "bytes", "oldest", "oldest age", "oldest in flight",
               *[f"age {t}" for t in _TAGS], *[f"size {t}" for t in _TAGS], "max attempts",
               "scheduled", "poison"]
    rows = []
    for q in analysis.queues:
        rows.append([
            _queue_name(q), q["kind"], f"{q['messages']:,}", *[f"{q[s]:,}" for s in STATES],
            _share(q["in_flight_share"]), format_bytes(q["bytes"]),
            _time(q["oldest"]), format_age(q["oldest_age_s"]),
            format_age(q["oldest_in_flight_age_s"]),
            *[format_age(q[f"age_{t}_s"]) for t in _TAGS],
            *[format_bytes(q[f"size_{t}"]) for t in _TAGS],
            "-" if q["max_attempts"] is None else q["max_attempts"],
            f"{q['scheduled']:,}", f"{q['poison']:,}",
        ])
    right = [False, False] + [True] * (len(headers) - 2)
    return headers, rows, right


def _window_summary_rows(analysis: Analysis) -> tuple[list[str], list[list[Any]], list[bool]]:
    """The summary of a window of retained logs: per topic, the columns its records have."""
    headers = ["topic", "messages", "bytes", "oldest", "newest", "oldest age",
               *[f"age {t}" for t in _TAGS], *[f"size {t}" for t in _TAGS], "size max"]
    rows = [[q["topic"], f"{q['messages']:,}", format_bytes(q["bytes"]), _time(q["oldest"]),
             _time(q["newest"]), format_age(q["oldest_age_s"]),
             *[format_age(q[f"age_{t}_s"]) for t in _TAGS],
             *[format_bytes(q[f"size_{t}"]) for t in _TAGS], format_bytes(q["size_max"])]
            for q in analysis.queues]
    return headers, rows, [False] + [True] * (len(headers) - 1)


# What a window of retained logs cannot tell, said wherever it is analysed.
_NOT_IN_LOG = ("records as published: no queue states (queued, in flight, deferred), attempts, due times or "
               "poison messages, which only a snapshot has (python -m spark_bridge snapshot)")


def _moment(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _topics(names: Sequence[str]) -> str:
    return f"topic {names[0]}" if len(names) == 1 else f"topics {', '.join(names)}"


def window_span(window: LogWindow) -> str:
    """`published from <time> until <time>`, or how else the window's ends were given."""
    if window.since is not None:
        start = f"published from {_moment(window.since)}"
    elif window.starting == "earliest":
        start = "from the earliest record kept"
    elif window.starting == "latest":
        start = "from the latest offset"
    else:
        start = "from the offsets given"
    if window.until is not None:
        end = f"until {_moment(window.until)}"
    elif window.ending == "latest":
        end = f"to the latest record at {_moment(window.resolved_at)}"
    else:
        end = "to the offsets given"
    return f"{start} {end}"


def _count(n: int, what: str) -> str:
    """`1 record`, `2,500 records`."""
    return f"{n:,} {what}" if n == 1 else f"{n:,} {what}s"


def _range_text(b: dict[str, Any]) -> str:
    """`offsets 100-349 (250 records, epoch E)`, and what could not be read of them."""
    if b["records"] == 0:
        text = f"no records (offset {b['start']}, epoch {b['epoch']})"
    else:
        text = f"offsets {b['start']}-{b['end'] - 1} ({_count(b['records'], 'record')}, epoch {b['epoch']})"
    lost = b["records"] - b["messages"]
    if lost > 0:
        text += f"; {lost:,} of them expired or were gone before they were read"
    return text


def _window_lines(analysis: Analysis) -> list[str]:
    """The header of a window's report: its span, its ranges per broker, and how to read it again."""
    w = analysis.window
    assert w is not None
    lost = sum(b["records"] - b["messages"] for b in analysis.brokers)
    count = f"{_count(analysis.total, 'message')} in {_topics(w.topics)}"
    if lost > 0:
        count += (f" ({lost:,} of the window's {_count(w.records, 'record')} expired or were gone before they "
                  "were read)")
    lines = [
        f"retained log of {_topics(w.topics)}, {window_span(w)}",
        f"  ages are measured from {_moment(analysis.as_of)} (the window's end)",
        f"  {_NOT_IN_LOG}",
        f"  {count}",
    ]
    lines += [f"  nsqd {b['nsqd']} {b['topic']}: {_range_text(b)}" for b in analysis.brokers]
    lines += [f"  nsqd {nsqd} has no topic {topic}" for topic, nsqd in w.missing]
    lines.append(f"  these records again: --start-offsets '{w.offsets_json(end=False)}' "
                 f"--end-offsets '{w.offsets_json(end=True)}'")
    return lines


def _by_queue(rows: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        out[_queue_name(r)].append(r)
    return out


def render_text(analysis: Analysis) -> str:
    """The terminal report: summary table, attempts, poison messages, deferred, JSON field.

    For a window of retained logs: its span and ranges, the summary per
    topic, the JSON field (records have no attempts or due times).
    """
    m = analysis.manifest
    if m is None:
        out = [*_window_lines(analysis), ""]
        out += _table(*_summary_rows(analysis))
        out += _json_lines(analysis)
        return "\n".join(out) + "\n"
    out = [
        f"snapshot {analysis.path}",
        f"  broker {m.broker_id}, taken {m.created_at} (ages are measured from then)",
        f"  {_source_line(analysis)}",
        f"  {analysis.total:,} messages in {len(analysis.queues)} queues: {_states_line(analysis)}",
        *[f"  {line}" for line in _left_out_lines(analysis)],
        "",
    ]
    out += _table(*_summary_rows(analysis))
    out += ["", "attempts (messages per number of attempts)"]
    attempts = _by_queue(analysis.attempts_histogram)
    out += _table(["queue", "attempts"],
                  [[name, "  ".join(f"{r['attempts']}:{r['messages']:,}" for r in rows)]
                   for name, rows in attempts.items()], [False, False])
    out += ["", f"poison messages (attempts > {analysis.poison_attempts}): "
                f"{analysis.poison_total:,}"]
    if analysis.poison:
        shown = analysis.poison[:20]
        out += _table(["queue", "message id", "attempts", "published", "size"],
                      [[_queue_name(p), p["message_id"], p["attempts"], _time(p["timestamp"]),
                        format_bytes(p["body_size"])] for p in shown],
                      [False, False, True, False, True])
        if analysis.poison_total > len(shown):
            out.append(f"  ... {analysis.poison_total - len(shown):,} more (see the HTML report "
                       "or poison_messages() for all)")
    out += ["", "deferred backlog by due time"]
    if analysis.deferred:
        out += _table(["queue", "due", "messages", "next due"],
                      [[_queue_name(d), d["bucket"], f"{d['messages']:,}", _time(d["next_due"])]
                       for d in analysis.deferred], [False, False, True, False])
    else:
        out.append("  none")
    out += _json_lines(analysis)
    return "\n".join(out) + "\n"


def _json_lines(analysis: Analysis) -> list[str]:
    """The terminal's JSON field table (nothing without --json-field)."""
    if analysis.json_field is None:
        return []
    out = ["", f"JSON field {analysis.json_field!r} (top 10 values per queue)"]
    rows = []
    for name, values in _by_queue(analysis.json_counts).items():
        for v in values[:10]:
            value = _NO_JSON_VALUE if v["json_value"] is None else v["json_value"]
            rows.append([name, value, f"{v['messages']:,}", format_bytes(v["bytes"])])
    return out + _table(["queue", "value", "messages", "bytes"], rows, [False, False, True, True])


# -- HTML ---------------------------------------------------------------------------


def load_charting() -> None:
    """Import matplotlib (~0.8 s), e.g. on a thread while Spark starts, so the report does not wait for it."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot  # noqa: F401


def _png(fig) -> str:
    """The figure as base64 PNG; the figure is closed (matplotlib keeps open ones alive)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=96, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _per_queue(rows: int):
    """A figure with one horizontal bar row per queue."""
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(8, 0.45 * rows + 1.6))


def _queue_chart(fig, ax, title: str, xlabel: str) -> tuple[str, str]:
    """(title, PNG) of a per-queue chart: queues top to bottom in report order."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.invert_yaxis()
    return title, _png(fig)


def _legend_outside(ax) -> None:
    """The legend right of the plot, where no bar runs under it (the PNG is cropped to fit it)."""
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def _stacked(title: str, rows: Sequence[dict[str, Any]], buckets: Sequence[tuple[str, float]],
             queues: Sequence[str]) -> tuple[str, str]:
    """A stacked bar per queue, one segment per bucket (a histogram per queue, side by side)."""
    import matplotlib.pyplot as plt

    labels = [label for label, _ in buckets]
    counts = {(_queue_name(r), r["bucket"]): r["messages"] for r in rows}
    fig, ax = _per_queue(len(queues))
    left = [0] * len(queues)
    cmap = plt.get_cmap("viridis", max(2, len(labels)))
    for i, label in enumerate(labels):
        values = [counts.get((q, label), 0) for q in queues]
        if any(values):
            ax.barh(queues, values, left=left, label=label, color=cmap(i))
            left = [a + b for a, b in zip(left, values, strict=True)]
    _legend_outside(ax)
    return _queue_chart(fig, ax, title, "messages")


def _charts(analysis: Analysis) -> list[tuple[str, str]]:
    """(title, base64 PNG) of each chart; only charts with something to show."""
    load_charting()
    import matplotlib.pyplot as plt

    charts: list[tuple[str, str]] = []
    queues = [_queue_name(q) for q in analysis.queues]
    if not queues:
        return charts
    try:
        if analysis.window is None:  # a window's records have no state
            # One segment per state: a stuck consumer is a long orange one.
            fig, ax = _per_queue(len(queues))
            left = [0] * len(queues)
            for s in STATES:
                values = [q[s] for q in analysis.queues]
                ax.barh(queues, values, left=left, label=_STATE_LABELS[s], color=_STATE_COLORS[s])
                left = [a + b for a, b in zip(left, values, strict=True)]
            _legend_outside(ax)
            charts.append(_queue_chart(fig, ax, "Backlog per queue by state", "messages"))

        aged = [(q, r["oldest_age_s"], r["oldest_in_flight_age_s"])
                for q, r in zip(queues, analysis.queues, strict=True)
                if r["oldest_age_s"] is not None]
        if aged:
            # Two bars per queue: the oldest message, and the oldest in flight
            # (none when nothing is).
            fig, ax = _per_queue(len(aged))
            ys = range(len(aged))
            ax.barh([y - 0.2 for y in ys], [max(a, 1e-3) for _, a, _ in aged], height=0.4,
                    color="tab:red", label="any state" if analysis.window is None else "oldest record")
            flying = [(y, f) for y, (_, _, f) in zip(ys, aged, strict=True) if f is not None]
            if flying:
                ax.barh([y + 0.2 for y, _ in flying], [max(f, 1e-3) for _, f in flying], height=0.4,
                        color=_STATE_COLORS["in_flight"], label="in flight")
            ax.set_yticks(list(ys), [q for q, _, _ in aged])
            ax.set_xscale("log")
            # Bars start at a power of ten below the shortest: log autoscaling
            # would start at the shortest one, which then shows as nothing.
            shortest = min(max(v, 1e-3) for _, a, f in aged for v in (a, f) if v is not None)
            ax.set_xlim(left=10 ** math.floor(math.log10(shortest)))
            _legend_outside(ax)
            charts.append(_queue_chart(fig, ax, "Oldest message age", "seconds (log scale)"))

        for title, rows, buckets in (
            ("Message ages", analysis.age_histogram, AGE_BUCKETS),
            ("Body sizes", analysis.size_histogram, SIZE_BUCKETS),
            ("Deferred backlog by due time", analysis.deferred, DUE_BUCKETS),
        ):
            if rows:
                charts.append(_stacked(title, rows, buckets, queues))

        if analysis.attempts_histogram:
            by_attempts: dict[int, int] = defaultdict(int)
            for r in analysis.attempts_histogram:
                by_attempts[r["attempts"]] += r["messages"]
            xs = sorted(by_attempts)
            fig, ax = plt.subplots(figsize=(8, 3.2))
            colors = ["tab:red" if x > analysis.poison_attempts else "tab:blue" for x in xs]
            heights = [by_attempts[x] for x in xs]
            ax.bar([str(x) for x in xs], heights, color=colors)
            # A poison tail is a handful next to thousands: log scale shows it,
            # when there is such a spread.
            spread = max(heights) / min(heights) > 20
            if spread:
                ax.set_yscale("log")
            ax.set_title(f"Attempts (red: poison, > {analysis.poison_attempts})")
            ax.set_xlabel("attempts")
            ax.set_ylabel("messages (log scale)" if spread else "messages")
            charts.append(("Attempts", _png(fig)))
    finally:
        plt.close("all")  # whatever a failing chart left open
    return charts


def _html_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }
th:first-child, td:first-child { text-align: left; }
figure { margin: 1.5em 0; }
"""


def _charts_html(analysis: Analysis) -> list[str]:
    return [f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{png}">'
            f"<figcaption>{html.escape(title)}</figcaption></figure>" for title, png in _charts(analysis)]


def _json_html(analysis: Analysis) -> list[str]:
    if analysis.json_field is None:
        return []
    return [f"<h2>JSON field {html.escape(repr(analysis.json_field))}</h2>",
            _html_table(["queue", "value", "messages", "bytes", "oldest"],
                        [[_queue_name(v), _NO_JSON_VALUE if v["json_value"] is None else v["json_value"],
                          v["messages"], v["bytes"], _time(v["oldest"])] for v in analysis.json_counts])]


def _window_html(analysis: Analysis) -> str:
    """The report of a window of retained logs: span, per topic, per broker, charts, JSON field."""
    w = analysis.window
    assert w is not None
    title = f"mqd retained log of {_topics(w.topics)}"
    header = _window_lines(analysis)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        *[f"<p>{html.escape(line.strip())}</p>" for line in header[:4]],
        "<h2>Topics</h2>",
        _html_table(*_summary_rows(analysis)[:2]),
        "<h2>Brokers</h2>",
        _html_table(["topic", "nsqd", "epoch", "offsets", "records", "read", "bytes", "oldest", "newest"],
                    [[b["topic"], b["nsqd"], b["epoch"],
                      f"{b['start']}-{b['end'] - 1}" if b["records"] else f"{b['start']} (none)",
                      f"{b['records']:,}", f"{b['messages']:,}", format_bytes(b["bytes"]), _time(b["oldest"]),
                      _time(b["newest"])] for b in analysis.brokers]),
        *[f"<p>{html.escape(line.strip())}</p>" for line in header[4 + len(analysis.brokers):]],
        *_charts_html(analysis),
        *_json_html(analysis),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def render_html(analysis: Analysis) -> str:
    """The report as one HTML page: the terminal's tables plus the charts, embedded."""
    m = analysis.manifest
    if m is None:
        return _window_html(analysis)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>mqd snapshot {html.escape(m.created_at)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>mqd snapshot {html.escape(m.created_at)}</h1>",
        f"<p>{html.escape(analysis.path)} &middot; broker {html.escape(str(m.broker_id))} &middot; "
        f"{analysis.total:,} messages in {len(analysis.queues)} queues "
        f"({html.escape(_states_line(analysis))}) &middot; "
        "ages are measured from the snapshot's time</p>",
        f"<p>{html.escape(_source_line(analysis))}</p>",
        *[f'<p class="left-out">{html.escape(line)}</p>' for line in _left_out_lines(analysis)],
        "<h2>Queues</h2>",
        _html_table(*_summary_rows(analysis)[:2]),
        "<h2>Queues by state</h2>",
        _html_table(["queue", "state", "messages", "bytes", "oldest", "oldest age"],
                    [[_queue_name(r), _STATE_LABELS.get(r["state"], r["state"]),
                      f"{r['messages']:,}", format_bytes(r["bytes"]), _time(r["oldest"]),
                      format_age(r["oldest_age_s"])]
                     for r in analysis.states]) if analysis.states else "<p>no messages</p>",
    ]
    parts += _charts_html(analysis)
    parts.append(f"<h2>Poison messages (attempts &gt; {analysis.poison_attempts}): "
                 f"{analysis.poison_total:,}</h2>")
    if analysis.poison:
        parts.append(_html_table(
            ["queue", "message id", "attempts", "published", "deferred until", "size"],
            [[_queue_name(p), p["message_id"], p["attempts"], _time(p["timestamp"]),
              _time(p["deferred_until"]), p["body_size"]] for p in analysis.poison]))
        if analysis.poison_total > len(analysis.poison):
            parts.append(f"<p>First {len(analysis.poison):,} shown.</p>")
    parts.append("<h2>Deferred backlog by due time</h2>")
    parts.append(_html_table(["queue", "due", "messages", "next due"],
                             [[_queue_name(d), d["bucket"], d["messages"], _time(d["next_due"])]
                              for d in analysis.deferred]) if analysis.deferred else "<p>none</p>")
    parts += _json_html(analysis)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_html(analysis: Analysis, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_html(analysis))
