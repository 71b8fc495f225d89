"""The operations around the tutorial's five files, each module called by name where it is used:

  checkpoint    what a run saves, written atomically; loading and resuming it
  housekeeping  settings from flags, checks, the out_dir's lock, signals, progress, one-line errors
  fast          device, dtype, compilation and CUDA graphs, kept off the reader's path
  datasets      image folders streamed from disk, and downloads
  adapters      timm and Hugging Face models as probe.py sees them
  probing       probe.py's command line: models side by side, the table, JSON, the figure
  export        a trained model out to timm or Hugging Face
"""
