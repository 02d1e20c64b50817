"""Generated planner tables: ``stages.py`` (stage tables) and ``checkpoint.py`` (copy spans).

Render functions registered in ``v41plan.codegen.targets.TARGETS``; both are deterministic
functions of the compiled spec.
"""

from __future__ import annotations

from v41plan.codegen.emit import header, render_template
from v41plan.codegen.literal import py_literal
from v41plan.geometry.runtime import CacheSpec


def render_stages(cs: CacheSpec) -> str:
    """``stages.py``: ``STAGE_TABLES`` for the four replay switch pairs."""
    from v41plan.planner.stages import derive_stage_table

    tables = {
        (dec, enc): derive_stage_table(cs, decoder_replay=dec, encoder_replay=enc)
        for dec in (True, False)
        for enc in (True, False)
    }
    prefix = "STAGE_TABLES: dict[tuple[bool, bool], StageTable] = "
    return render_template(
        "stages.py.j2",
        header=header(cs),
        spec_name=cs.name,
        tables=py_literal(tables, "", prefix),
    )


def render_checkpoint(cs: CacheSpec) -> str:
    """``checkpoint.py``: image span rows, regions and sizes per pool geometry."""
    from v41plan.planner.checkpoint import image_layout, layout_rows, regions

    every = (*cs.geometries.values(), *cs.speculative_geometries.values())
    geoms = sorted(every, key=lambda g: g.layout_id)
    spans = {g.layout_id: layout_rows(image_layout(g)) for g in geoms}
    return render_template(
        "checkpoint.py.j2",
        header=header(cs),
        spec_name=cs.name,
        image_bytes=py_literal({g.layout_id: g.image_bytes for g in geoms}),
        units=py_literal({g.layout_id: g.units_per_image for g in geoms}),
        regions=py_literal({g.layout_id: regions(g) for g in geoms}),
        spans=py_literal(spans),
    )
