# JupyterLab for the book (`make lab`, and tests/test_lab.py): the notebooks
# are handed to JupyterLab with the numbers, citations and cross-references the
# book shows (lab_view.py).
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

c = get_config()  # noqa: F821 - Jupyter's config loader provides it
c.ServerApp.contents_manager_class = "lab_view.BookContentsManager"
