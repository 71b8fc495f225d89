#!/usr/bin/env bash
# Experiment 11 (results/e11/PLAN.md): results/e6.sh with experiment 11's committed design, one arm per command.
RESULTS=${RESULTS:-results/e11} exec bash "$(dirname "$0")/e6.sh" "$@"
