"""pytest set-up for the lab's tests: the repository root on the import path (test_all.py, train.py, ...).

Run: python -m pytest -q results
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
