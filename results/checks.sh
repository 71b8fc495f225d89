#!/usr/bin/env bash
# The checks that results/*.sh make of the settings they take from the environment, in one place: each prints one
# line that says what is wrong and exits 2, so a script calls them before it writes anything.
#   source results/checks.sh; positive_whole STEPS "of steps"; seed_list SEEDS; layer_decay_in_range; reusable FROM TO;
#   cifar_folder DATA
# and, once checked, reuse_arm FROM TO: the link that takes a reused arm's place.
positive_whole() {  # positive_whole VARIABLE WHAT: one line and exit 2 unless the variable is a positive whole number
  case ${!1} in ''|*[!0-9]*|0*) echo "$1 must be a positive whole number $2, got '${!1}'" >&2; exit 2 ;; esac
}
seed_list() {  # seed_list VARIABLE: one line and exit 2 unless the variable is seeds (whole numbers) separated by spaces
  if ! [[ ${!1} =~ ^\ *[0-9]+(\ +[0-9]+)*\ *$ ]]; then
    echo "$1 must be seeds (whole numbers) separated by spaces, as in \"0 1 2\", got '${!1}'" >&2; exit 2
  fi
}
cifar_folder() {  # cifar_folder DATA: one line and exit 2 unless DATA/cifar10-jpeg holds train/
  if [ ! -d "$1/cifar10-jpeg/train" ]; then
    echo "no CIFAR-10 folder at $1/cifar10-jpeg (train/ and test/): point DATA at the folder above it" >&2; exit 2
  fi
}
layer_decay_in_range() {  # one line and exit 2 unless LAYER_DECAY is a number in (0, 1]
  if ! [[ $LAYER_DECAY =~ ^(1(\.0*)?|0?\.[0-9]*[1-9][0-9]*)$ ]]; then
    echo "LAYER_DECAY must be a number in (0, 1] (1 turns it off), got '$LAYER_DECAY'" >&2; exit 2
  fi
}
reusable() {  # reusable FROM TO: one line and exit 2 unless the arm FROM has a checkpoint and TO is not a run of its own
  [ -f "$1/ckpt.pt" ] || { echo "REUSE: no $1/ckpt.pt; run without REUSE first" >&2; exit 2; }
  if [ -e "$2" ] && [ ! -L "$2" ]; then echo "REUSE: $2 holds a run of its own; move it away" >&2; exit 2; fi
}
reuse_arm() {  # reuse_arm FROM TO: TO becomes a link to the arm FROM (absolute, so it holds from any folder)
  mkdir -p "$(dirname "$2")"
  ln -sfn "$(cd "$1" && pwd)" "$2"
}
