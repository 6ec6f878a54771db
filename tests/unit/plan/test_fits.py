"""The table "what fits on which card": its cells are kiln plan's, the docs page and the README hold the tables
this module makes (regenerated with one command), and the cells say what the presets promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.plan import fits

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def found():
    return fits.cells()


def test_each_preset_fits_the_card_it_is_made_for_and_not_the_one_below(found):
    assert found[("cpt-8b-16gb", "16 GB")].fits and not found[("cpt-8b-1gpu", "16 GB")].fits
    assert found[("cpt-8b-1gpu", "24 GB")].fits and found[("cpt-8b-24gb", "24 GB")].fits
    assert not found[("cpt-8b-4gpu", "80 GB")].fits
    four = found[("cpt-8b-4gpu", "4x 80 GB")]
    assert four.fits and four.ac == "full"  # batch 4 at 8192 tokens: selective does not fit
    assert found[("cpt-8b-24gb", "4x 80 GB")].ac is None  # train.offload runs in one process
    qlora, lora = found[("cpt-8b-16gb", "80 GB")], found[("cpt-8b-1gpu", "80 GB")]
    assert qlora.peak < lora.peak - 8 * 2**30 and qlora.tokens_per_s_per_gpu < lora.tokens_per_s_per_gpu


def test_a_cell_is_kiln_plan_with_the_fastest_checkpointing_that_fits(found):
    from kiln.config import load_config
    from kiln.plan import make_plan
    from kiln.plan.gpus import GPUS

    cell = found[("cpt-8b-1gpu", "24 GB")]
    plan = make_plan(load_config("cpt-8b-1gpu", [*fits.SHAPE, f"train.activation_checkpointing={cell.ac}"]), 1,
                     GPUS["rtx4090"])
    assert plan.fits and plan.memory.peak == cell.peak and plan.tokens_per_s == cell.tokens_per_s_per_gpu
    faster = make_plan(load_config("cpt-8b-1gpu", [*fits.SHAPE, "train.activation_checkpointing=selective"]), 1,
                       GPUS["rtx4090"])
    assert cell.ac == "full" and not faster.fits


def test_the_docs_and_the_readme_hold_the_planned_tables(found, tmp_path):
    for rel, (name, make) in fits.TARGETS.items():
        text = (ROOT / rel).read_text()
        assert fits.section(text, name) == make(found), f"{rel} is stale: run python -m kiln.plan.fits --write"
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{fits.BEGIN.format('planned')}\nold\n{fits.END}\nafter\n")
    again = fits.replace_section(page.read_text(), "planned", "| a |")
    assert again == f"intro\n{fits.BEGIN.format('planned')}\n\n| a |\n\n{fits.END}\nafter\n"
    assert fits.section(again, "planned") == "| a |"
    with pytest.raises(ValueError, match="section"):
        fits.replace_section("no markers", "planned", "x")
