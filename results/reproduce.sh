#!/usr/bin/env bash
# Re-create every run, probe JSON and figure in results/ from scratch, on CPU.
#   bash results/reproduce.sh [DATA]    DATA defaults to ../shared/data (CIFAR-10 JPEGs, WikiText-2, GPT-2 BPE)
# Runs are sequential; each writes out/<name>/ (checkpoint + log.jsonl) and results/logs/<name>.jsonl.
# A run whose checkpoint is complete is skipped, so the script can be resumed after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-../shared/data}
CIFAR="--dataset folder --data_dir $DATA/cifar10-jpeg"
WIKI="--dataset text --data_dir $DATA/wikitext-2 --train_file valid.txt --val_file test.txt --tokenizer r50k_base"
WIKI_PROBE="--dataset text --data_dir $DATA/wikitext-2 --val_file test.txt --tokenizer r50k_base"
export TIKTOKEN_CACHE_DIR=$DATA/tiktoken  # GPT-2's BPE ranks (r50k_base) without network
PY=${PYTHON:-python}
mkdir -p results/logs out

train() {  # train NAME FLAGS...: one run, skipped when its checkpoint reached max_iters
  local name=$1; shift
  if [ -f "out/$name/ckpt.pt" ] && $PY -c "import torch,sys; c=torch.load('out/$name/ckpt.pt',weights_only=True); sys.exit(c['step']!=c['train']['max_iters'])"; then
    echo "== $name: done already"; cp "out/$name/log.jsonl" "results/logs/$name.jsonl"; return
  fi
  echo "== $name"
  rm -rf "out/$name"
  # pipefail: a failed run stops the script; the progress bar is dropped from the printed log
  /usr/bin/env time -f "== $name took %e s" $PY train.py "$@" --out_dir "out/$name" 2>&1 | tr '\r' '\n' | grep --line-buffered -v "it/s\|s/it"
  cp "out/$name/log.jsonl" "results/logs/$name.jsonl"
}

VISION="--preset cifar-deep $CIFAR --batch_size 128 --max_iters 1500 --warmup 100 --lr 2e-3 --eval_interval 500"
TEXT="--preset wikitext-deep $WIKI --batch_size 16 --max_iters 400 --warmup 40 --lr 2e-3 --eval_interval 100 --eval_samples 1024"

# Experiment 1 (Bamboo Fig. 1-2): classification from scratch against MAE pre-training, same 24x64 trunk and init.
train e1-cls $VISION --objective cls
train e1-mae $VISION --objective mae
# ... and MAE's second stage: fine-tune the pre-trained encoder (Bamboo's protocol, layer-wise lr decay).
train e1-mae-ft --objective cls --init_from out/e1-mae/ckpt.pt $CIFAR --batch_size 128 --max_iters 1000 \
  --warmup 50 --lr 2e-3 --layer_decay 0.75 --eval_interval 500
# Experiment 2 (NeuTRENO Fig. 1, G.3, Table 1): lambda 0.6 against e1-cls on images, 0.4 against 0 on text.
train e2-cls-neutreno $VISION --objective cls --neutreno 0.6
train e2-next $TEXT --objective next
train e2-next-neutreno $TEXT --objective next --neutreno 0.4
# Experiment 3 (Bamboo 2.4): masked tokens against next token on the same text trunk (e2-next is the next arm).
train e3-mlm $TEXT --objective mlm
# Experiment 5 (Dovonon et al.): the same cls run, smoothing against sharpening by construction
# (500 steps each, to fit this session's CPU budget; e1-cls, the free arm, had 1500).
train e5-smooth $VISION --objective cls --vo_param smooth --max_iters 500
train e5-sharpen $VISION --objective cls --vo_param sharpen --max_iters 500

# Probes: 256 fixed test samples per checkpoint; one JSON and one figure per comparison.
probe() { local name=$1; shift; $PY probe.py "$@" --samples 256 --json "results/$name.json" --plot "results/$name.png" > "results/$name.txt"; echo "== probe $name"; }
probe e1-objective out/e1-cls/ckpt.pt out/e1-mae/ckpt.pt out/e1-mae-ft/ckpt.pt --labels cls,mae,mae-finetuned $CIFAR
probe e2-neutreno-init init:cifar-deep init:cifar-deep,neutreno=0.6 --labels "softmax (init)","neutreno 0.6 (init)" $CIFAR
probe e2-neutreno out/e1-cls/ckpt.pt out/e2-cls-neutreno/ckpt.pt --labels softmax,"neutreno 0.6" $CIFAR
probe e2-neutreno-text out/e2-next/ckpt.pt out/e2-next-neutreno/ckpt.pt --labels softmax,"neutreno 0.4" $WIKI_PROBE
probe e3-text-objectives out/e2-next/ckpt.pt out/e3-mlm/ckpt.pt --labels next,mlm $WIKI_PROBE
probe e5-vo-param out/e5-smooth/ckpt.pt out/e5-sharpen/ckpt.pt out/e1-cls/ckpt.pt --labels smooth,sharpen,"free (1500 steps)" $CIFAR
probe e5-vo-param-init init:cifar-deep,vo_param=smooth init:cifar-deep,vo_param=sharpen init:cifar-deep --labels smooth,sharpen,free $CIFAR
$PY results/summarize.py  # tables of final metrics and the training-curve figure
