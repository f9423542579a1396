"""Great Expectations gates for curate: a suite on the parsed input and one on the output.

A failed expectation fails the node with a readable report (rule, count, examples); since curate
writes into a temp folder that is only renamed on success, nothing curated is published.
"""
from __future__ import annotations

import os

import pandas as pd

os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")


class GateFailed(ValueError):
    """One or more expectations failed; the message is the readable report."""


def _context():
    import great_expectations as gx  # great_expectations: seconds to import, only when the gates run
    from great_expectations.data_context.types.base import ProgressBarsConfig
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False)
    return gx, ctx


def validate(name: str, df: pd.DataFrame, expectations: list) -> dict:
    """Run `expectations` on `df`; return a JSON-able summary; raise GateFailed if any fails."""
    gx, ctx = _context()
    batch = ctx.data_sources.add_pandas(name).add_dataframe_asset("rows").add_batch_definition_whole_dataframe("all")
    suite = ctx.suites.add(gx.ExpectationSuite(name=name))
    for e in expectations:
        suite.add_expectation(e)
    result = ctx.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite)).run(
        batch_parameters={"dataframe": df})
    rules = []
    for r in result.results:
        kwargs = {k: v for k, v in r.expectation_config.kwargs.items() if k not in ("batch_id",)}
        rules.append({"rule": r.expectation_config.type, "kwargs": kwargs, "success": bool(r.success),
                      "unexpected_count": int(r.result.get("unexpected_count") or 0),
                      "examples": [str(x)[:80] for x in (r.result.get("partial_unexpected_list") or [])[:5]]})
    summary = {"suite": name, "rows": len(df), "success": bool(result.success), "rules": rules}
    if not result.success:
        lines = [f"curate gate '{name}' failed on {len(df)} rows:"]
        for r in rules:
            if not r["success"]:
                lines.append(f"  {r['rule']} {r['kwargs']}: {r['unexpected_count']} rows fail, e.g. {r['examples']}")
        raise GateFailed("\n".join(lines))
    return summary


def input_expectations(min_nonempty: float = 0.5) -> list:
    import great_expectations as gx  # great_expectations: seconds to import, only when the gates run
    E = gx.expectations
    return [
        E.ExpectTableColumnsToMatchSet(column_set=["id", "text", "source"], exact_match=False),
        E.ExpectColumnValuesToNotBeNull(column="text", mostly=min_nonempty),
        E.ExpectColumnValuesToBeOfType(column="text", type_="str"),
        # most rows must carry text: an empty or mis-mapped field is a schema problem, not noise
        E.ExpectColumnValueLengthsToBeBetween(column="text", min_value=1, mostly=min_nonempty),
    ]


def output_expectations(min_chars: int, max_chars: int) -> list:
    import great_expectations as gx  # great_expectations: seconds to import, only when the gates run
    E = gx.expectations
    return [
        E.ExpectColumnValuesToBeUnique(column="id"),
        E.ExpectColumnValueLengthsToBeBetween(column="text", min_value=min_chars, max_value=max_chars),
        E.ExpectColumnValuesToBeInSet(column="contaminated", value_set=[False]),
    ]


def global_id_expectations() -> list:
    """Ids unique across all files (each file's output gate checks its own rows)."""
    import great_expectations as gx  # great_expectations: seconds to import, only when the gates run
    return [gx.expectations.ExpectColumnValuesToBeUnique(column="id_hash")]


def split_expectations() -> list:
    import great_expectations as gx  # great_expectations: seconds to import, only when the gates run
    return [gx.expectations.ExpectColumnValuesToBeUnique(column="task_id")]
