"""The operations around the tutorial's five files, one concern a module, each called by name where
it is used. Imports point one way, down this list (test_all.py checks it):

  cli         flags, model specs, output paths, and the one line a user's mistake becomes
  checkpoint  what a run saves, written atomically; loading and resuming it
  fast        device, dtype, compilation and CUDA graphs, kept off the reader's path
  figures     matplotlib without a screen, figures written whole
  files       image folders listed and decoded, text tokenized, caches, downloads
  adapters    timm and Hugging Face models as probe.py sees them
  hub         timm and Hugging Face models and tokenizers from a spec, failing offline in one line
  (data.py)
  streaming   image folders streamed from disk, and the choice between that and data.ImageData
  checks      a run's settings checked before any work, and what a resume must find unchanged
  out_dir     one run at a time in an out_dir, and never another run's files
  runlog      log.jsonl, what made the run, and the one reader of the log
  progress    progress, the time limit, signals, a non-finite loss, the resume hint
  (probe.py)
  export      a trained model out to timm or Hugging Face
  (train.py, look.py, bench.py)
"""
