"""scripts/quality_md.py --findings: the findings section of docs/QUALITY.md copied in again
from bench/model/FINDINGS.md, the run's tables before it left byte for byte."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("quality_md", ROOT / "scripts" / "quality_md.py")
quality_md = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality_md)


def test_findings_are_copied_in_and_the_tables_kept(tmp_path):
    tables = "# Quality\n\n## Every policy\n\n| policy | budget |\n| --- | --- |\n| full | all |\n\n"
    (tmp_path / "QUALITY.md").write_text(tables + "## Findings\n\n1. An old finding.\n")
    quality_md.refresh_findings(tmp_path)
    page = (tmp_path / "QUALITY.md").read_text()
    findings = (ROOT / "bench" / "model" / "FINDINGS.md").read_text().strip()
    assert page == tables + "## Findings\n\n" + findings + "\n"
    quality_md.refresh_findings(tmp_path)  # again: the same page
    assert (tmp_path / "QUALITY.md").read_text() == page


def test_a_page_without_findings_is_left_alone(tmp_path):
    (tmp_path / "QUALITY.md").write_text("# Quality\n\nno findings here\n")
    with pytest.raises(SystemExit, match="no findings section"):
        quality_md.refresh_findings(tmp_path)
    assert (tmp_path / "QUALITY.md").read_text() == "# Quality\n\nno findings here\n"
