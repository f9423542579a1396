"""The HTML report a reviewer reads first: score table, pass@k, plots (score by stage per suite,
long-context accuracy against length, generated tokens against accuracy with thinking on and off),
quantization figures and the regression gates. One self-contained file (plots inlined as PNG), so the
same page works as an MLflow artifact, a Flyte report and a file opened from disk."""
from __future__ import annotations

import base64
import html
import os
import shutil
import subprocess
from pathlib import Path

PLOTS = {"score_by_stage.png": "Score by stage, per suite (greedy; pass@k dashed)",
         "long_context.png": "Long-context accuracy against context length",
         "thinking_tokens.png": "Generated tokens against accuracy, thinking on and off"}


def _domains(scores: dict) -> list[str]:
    """The task domains: suites scored with thinking on and off (not the held-out `chat`, asked with it off)."""
    suites = columns(scores)
    return [s for s in suites if f"{s}:nothink" in suites]


def _lengths(scores: dict) -> list[int]:
    return sorted({int(s.split("@")[1]) for ss in scores.values() for s in ss if "@" in s})


def save_plots(report: dict, folder: Path) -> None:
    import matplotlib  # matplotlib: only when plotting (a second to import)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # matplotlib: only when plotting (a second to import)
    scores, tokens, passk = report["eval"], report["tokens"], report.get("pass_at_k", {})
    cks, domains, lengths = list(scores), _domains(scores), _lengths(scores)

    fig, ax = plt.subplots(figsize=(9, 4))
    extra = ["chat"] if "chat" in columns(scores) else []
    for i, d in enumerate([*domains, *extra, *([f"long_context@{lengths[-1]}"] if lengths else [])]):
        line, = ax.plot(range(len(cks)), [scores[c].get(d, float("nan")) for c in cks], "o-", label=d)
        ks = [c for c in cks if d in passk.get(c, {})]
        if ks:
            k = max(passk[ks[0]][d], key=lambda x: int(x.split("@")[1]))
            ax.plot([cks.index(c) for c in ks], [passk[c][d][k] for c in ks], "--", color=line.get_color(), alpha=0.7,
                    label=f"{d} {k}")
    ax.set_xticks(range(len(cks)), cks, rotation=30, ha="right")
    ax.set_ylabel("test score")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(folder / "score_by_stage.png", dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for c in cks:
        ax.plot(lengths, [scores[c][f"long_context@{L}"] for L in lengths], "o-", label=c)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(L) for L in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "long_context.png", dpi=90)
    plt.close(fig)

    chat = [c for c in cks if f"{domains[0]}:nothink" in scores[c]]
    fig, axes = plt.subplots(1, len(domains), figsize=(4 * len(domains), 3.6), squeeze=False)
    for ax, d in zip(axes[0], domains):
        for i, c in enumerate(chat):
            color = f"C{i}"
            on, off = (tokens[c][d], scores[c][d]), (tokens[c][f"{d}:nothink"], scores[c][f"{d}:nothink"])
            ax.plot(*zip(on, off), "-", color=color, alpha=0.4)
            ax.plot(*on, "o", color=color, label=c)
            ax.plot(*off, "o", mfc="none", color=color)
        ax.set_title(f"{d} (filled: thinking on, hollow: off)", fontsize=9)
        ax.set_xlabel("mean generated tokens")
        ax.set_ylabel("test score")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "thinking_tokens.png", dpi=90)
    plt.close(fig)


def columns(rows: dict[str, dict]) -> list[str]:
    """Every suite any row has, in first-seen order (chat-only suites such as `agentic:turns` are absent from
    the completion-scored checkpoints)."""
    return list(dict.fromkeys(c for vs in rows.values() for c in vs))


def _cell(v: float | None) -> str:
    if v is None:
        return "<td>-</td>"
    hue = int(120 * max(0.0, min(1.0, v)))  # red (0) to green (1)
    return f'<td style="background:hsl({hue},60%,85%)">{v:.2f}</td>'


def _table(rows: dict[str, dict[str, float]]) -> str:
    cols = columns(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join(f"<tr><th>{html.escape(r)}</th>{''.join(_cell(vs.get(c)) for c in cols)}</tr>" for r, vs in rows.items())
    return f"<table><tr><th>checkpoint</th>{head}</tr>{body}</table>"


def passk_rows(passk: dict) -> dict[str, dict[str, float]]:
    """report.json's pass_at_k as one row per checkpoint, a column per suite and k."""
    return {c: {f"{s} {k}": v for s, kv in p.items() for k, v in kv.items()} for c, p in passk.items()}


def _passk_table(passk: dict) -> str:
    return _table(passk_rows(passk)) if passk else "<p>No sampled evaluation (eval.samples = 0).</p>"


def _quant_table(q: dict) -> str:
    if not q:
        return ""
    mb = 1 / 2 ** 20
    rows = [("linear-layer weights", q["linear_weight_bytes"] * mb, q["linear_weight_bytes_bf16"] * mb,
             "bf16"),
            ("checkpoint on disk", q["disk_bytes"] * mb, q["disk_bytes_unquantized"] * mb, "as trained"),
            ("model in memory", q["model_memory_bytes"] * mb, q["model_memory_bytes_unquantized"] * mb, "fp32 on CPU"),
            ("process RSS growth, load + generate", q["rss_growth_bytes"] * mb, q["rss_growth_bytes_unquantized"] * mb,
             "fresh process"),
            ("process peak RSS (imports included)", q["peak_rss_bytes"] * mb, q["peak_rss_bytes_unquantized"] * mb,
             "fresh process")]
    body = "".join(f"<tr><th>{n}</th><td>{a:.3f}</td><td>{b:.3f}</td><td>{a / b:.1%}</td><td>{r}</td></tr>"
                   for n, a, b, r in rows)
    return (f"<p>{html.escape(str(q['format']))}; rounding: {html.escape(str(q['method']))} on "
            f"{q['calibration_tokens']} calibration tokens.</p><table><tr><th></th><th>quantized MiB</th>"
            f"<th>unquantized MiB</th><th>ratio</th><th>unquantized as</th></tr>{body}</table>"
            f"<p>Reloaded in a fresh process, it answered: <code>{html.escape(q['fresh_process_text'])}</code></p>")


def _gates(g: dict | None) -> str:
    if not g:
        return ""
    if not g["checks"]:
        return "<h2>Regression gates</h2><p>No gates configured (<code>gates.min</code>, <code>gates.max_drop</code>).</p>"
    rows = "".join(f'<tr class="{"ok" if c["passed"] else "bad"}"><td>{"pass" if c["passed"] else "FAIL"}</td>'
                   f"<td>{html.escape(c['message'])}</td></tr>" for c in g["checks"])
    verdict = "all gates pass" if g["passed"] else "a gate failed: the pipeline run failed and the model was not registered"
    return f"<h2>Regression gates on {html.escape(g['checkpoint'])}: {verdict}</h2><table>{rows}</table>"


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:3px 7px;font-size:13px;text-align:right}th{background:#f4f4f4}
tr.ok td,tr.bad td{text-align:left}tr.ok td:first-child{color:#080;font-weight:bold}tr.bad td:first-child{color:#b00;font-weight:bold}
img{max-width:100%;border:1px solid #eee;margin:.3em 0}"""


def _sampling(report: dict) -> str:
    s = report.get("sampling", {})
    return f"{s.get('samples', 0)} per task at temperature {s.get('temperature', '-')}; a sample passes on full reward"


def _lineage(report: dict) -> str:
    """What a reviewer audits: code and config versions, each stage's artifact and digest, the registered model."""
    if "stages" not in report:
        return ""
    e = html.escape
    reg = report.get("registered_model")
    head = (f"<p>git <code>{e(report.get('git_sha', '-'))}</code>, config digest "
            f"<code>{e(report.get('config_digest', '-')[:16])}</code>, MLflow run "
            f"<code>{e(report.get('mlflow_run_id', '-'))}</code>; registered model "
            + (f"<code>{e(reg)}</code> (audit: <code>posttrain lineage {e(reg)}</code>)" if reg else
               "none (gates failed or no quantize stage)") + "</p>")
    rows = "".join(f"<tr class='ok'><td>{e(s)}</td><td><code>{e(v['sha256'][:16])}</code></td>"
                   f"<td>{'cached' if v.get('cached') else 'computed'}</td><td>{e(str(v['artifact']))}</td></tr>"
                   for s, v in report["stages"].items())
    return (f"<h2>Lineage</h2>{head}<table><tr><th>stage</th><th>sha256</th><th>this run</th><th>artifact "
            f"(the raw stage holds the inputs)</th></tr>{rows}</table>")


def body(report: dict, folder: Path) -> str:
    """The report's content (no <html> wrapper): what a Flyte report tab shows."""
    plots = {**PLOTS, **{n: t for n, t in report.get("extra_plots", {}).items() if (folder / n).is_file()}}
    imgs = "".join(f"<h3>{t}</h3><img alt='{n}' src='data:image/png;base64,"
                   f"{base64.b64encode((folder / n).read_bytes()).decode()}'>" for n, t in plots.items())
    head = (f"<p>run <code>{html.escape(report['run_id'])}</code>, profile {html.escape(report['profile'])}</p>"
            if "run_id" in report else "")
    return (f"<h1>posttrain evaluation</h1>{head}{_gates(report.get('gates'))}"
            f"<h2>Test scores (greedy; <code>:nothink</code> = thinking off)</h2>{_table(report['eval'])}"
            f"<h2>Sampled answers ({_sampling(report)}), pass@k</h2>{_passk_table(report.get('pass_at_k', {}))}"
            f"<h2>Plots</h2>{imgs}<h2>Quantization (W4A8)</h2>{_quant_table(report.get('quantization', {}))}"
            f"{_lineage(report)}")


def write(report: dict, folder: Path) -> Path:
    """Plots and report.html into `folder`; returns the page's path."""
    save_plots(report, folder)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>posttrain report</title>"
            f"<style>{STYLE}</style></head><body>{body(report, folder)}</body></html>")
    (folder / "report.html").write_text(page)
    return folder / "report.html"


def chromium() -> str | None:
    return os.environ.get("POSTTRAIN_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome", "chrome")) if p), None)


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 2600) -> Path:
    """Render `page` in headless Chromium and save a screenshot (what a reviewer's browser shows)."""
    exe = chromium()
    if exe is None:
        raise FileNotFoundError("no Chromium found for the screenshot: install it (Debian: apt-get install chromium) "
                                "or point POSTTRAIN_CHROMIUM at the binary")
    subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={png}", page.resolve().as_uri()],
                   check=True, capture_output=True, timeout=120)
    return png
