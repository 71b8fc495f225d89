"""pytest set-up for the lab's tests: the repository root on the import path, and test_all.py's
tiny data as a fixture here too.

Run: python -m pytest -q results
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from test_all import tiny_data  # noqa: E402, F401 (a fixture the lab's tests share)
