"""The generated stage tables and span tables: equal to the derived ones, used at run time,
importable without pydantic, ruamel.yaml or torch."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest

from v41plan.geometry.runtime import load_cache_spec
from v41plan.planner.checkpoint import image_layout, layout_rows, load_image_layout
from v41plan.planner.stages import derive_stage_table, stage_table

SHIPPED = ("deepseek_v41_flash", "flash_slice", "medium", "tiny", "tiny40", "tiny40_dspark")


@pytest.mark.parametrize("name", SHIPPED)
def test_generated_stage_tables_match_and_are_used(name):
    cs = load_cache_spec(name)
    mod = importlib.import_module(f"v41plan.generated.{name}.stages")
    for (dec, enc), table in mod.STAGE_TABLES.items():
        assert table == derive_stage_table(cs, decoder_replay=dec, encoder_replay=enc)
        assert stage_table(cs, decoder_replay=dec, encoder_replay=enc) is table


@pytest.mark.parametrize("name", SHIPPED)
def test_generated_span_tables_match(name):
    cs = load_cache_spec(name)
    for g in (*cs.geometries.values(), *cs.speculative_geometries.values()):
        assert load_image_layout(g, name).layout_id == g.layout_id
        assert layout_rows(load_image_layout(g, name)) == layout_rows(image_layout(g))


def test_a_changed_spec_does_not_use_a_stale_table():
    import dataclasses

    cs = load_cache_spec("tiny")
    other = dataclasses.replace(cs, spec_sha256="0" * 64)
    assert stage_table(other) is not stage_table(cs)
    assert stage_table(other).rows == stage_table(cs).rows


def test_planner_and_generated_code_import_without_pydantic_ruamel_torch():
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("pydantic", "ruamel", "torch"):
                    raise ImportError("blocked " + name)
                return None

        sys.meta_path.insert(0, Block())
        from v41plan.geometry.runtime import load_cache_spec
        from v41plan.planner.step import RequestInput, StepInput, plan_step
        from v41plan.planner.checkpoint import CopyPlanner, load_image_layout
        import v41plan.generated.deepseek_v41_flash.stages
        import v41plan.generated.deepseek_v41_flash.checkpoint

        cs = load_cache_spec("deepseek_v41_flash")
        p = plan_step(StepInput((RequestInput(0, (0, 1), 200, 0, 200),)), cs)
        g = cs.geometry()
        CopyPlanner(g, 64, 4, load_image_layout(g, cs.name))
        assert p.graph_key == ("prefill_replay", 1, 200)
        assert not any(m.split(".")[0] in ("pydantic", "ruamel", "torch") for m in sys.modules)
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
