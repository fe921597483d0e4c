"""The benchmark harness: one provider registry, suites, a runner, JSON/CSV results.

    from sparse_attn.bench import get_suite, run_suite, summary_table
    rows = run_suite(get_suite("small"), "cpu")

See :mod:`.registry` (providers, modes), :mod:`.flops` (effective FLOPs), :mod:`.timing`,
:mod:`.suites`, :mod:`.runner`, :mod:`.results`.
"""
from .flops import attention_flops, block_density, visited_blocks
from .registry import MODES, PROVIDERS, Provider, get_provider, provider_names, register_provider
from .results import ROW_FIELDS, Row, load_json, make_header, summary_table, write_csv, write_json
from .runner import check_providers, expand, run_suite
from .suites import SUITES, Case, PatternSpec, Suite, get_suite, restrict, spec

__all__ = ["attention_flops", "block_density", "visited_blocks", "MODES", "PROVIDERS", "Provider",
           "get_provider", "provider_names", "register_provider", "ROW_FIELDS", "Row", "load_json",
           "make_header", "summary_table", "write_csv", "write_json", "check_providers", "expand",
           "run_suite", "SUITES", "Case", "PatternSpec", "Suite", "get_suite", "restrict", "spec"]
