"""The out_dir: claimed for one run at a time (a lock on out_dir/.lock), never another run's files
unless --resume or --overwrite, and left as found if the run wrote nothing.

Run: python train.py --out_dir out (twice at once: the second stops in one line)
"""
import errno
import glob
import os
from contextlib import contextmanager, suppress

from operations.cli import RUN_FILES, TrainingError


@contextmanager
def out_dir_claimed(out, resume, overwrite, writes=True):
    """with out_dir_claimed(...): the run, in a writable out_dir locked for it, holding no other
    run's files unless --resume or --overwrite, cleared of a killed write's temp files. An empty
    folder this run made goes at the end; a process that writes nothing touches nothing."""
    if not writes:
        yield
        return
    if os.path.exists(out) and not os.path.isdir(out):
        raise TrainingError(f"--out_dir {out} is a file, not a folder; choose another --out_dir")
    created = not os.path.exists(out)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise TrainingError(f"cannot create --out_dir {out} ({e.strerror}); choose another")
    if not os.access(out, os.W_OK | os.X_OK):
        raise TrainingError(f"--out_dir {out} is not writable: fix its permissions or use another")
    lock = lock_out_dir(out)
    try:
        linked = [n for n in RUN_FILES if os.path.islink(os.path.join(out, n))]
        if linked:  # never read, appended to or removed through a link out of out_dir
            raise TrainingError(f"{os.path.join(out, linked[0])} is a link; a run writes only its "
                                "own files in --out_dir; remove the link")
        for name in RUN_FILES:  # atomic_write's temporary files (mkstemp's names), only
            for tmp in glob.glob(os.path.join(glob.escape(out), f".{name}.{'[a-z0-9_]' * 8}.tmp")):
                os.remove(tmp)
        taken = [n for n in ("ckpt.pt", "log.jsonl") if os.path.exists(os.path.join(out, n))]
        if taken and not resume and not overwrite:
            go_on = ("continue it with --resume, " if "ckpt.pt" in taken
                     else "it saved no checkpoint to resume; ")
            raise TrainingError(f"--out_dir {out} holds another run ({', '.join(taken)}); {go_on}"
                                "choose another --out_dir, or pass --overwrite to replace it")
        yield
    finally:
        release_out_dir(out, lock, created)


def remove_old_run(out):
    """--overwrite, once the new run has passed every check: the old run's files go, said."""
    old = [name for name in RUN_FILES if os.path.exists(os.path.join(out, name))]
    for name in old:
        os.remove(os.path.join(out, name))
    if old:
        print(f"--overwrite: removed the old run's {' '.join(old)} from {out}", flush=True)


def lock_out_dir(out):
    """A POSIX lock on out_dir/.lock for this process's lifetime (forked DataLoader workers do not
    inherit it): a second run into the same folder stops at once. None where there is no fcntl."""
    try:
        import fcntl
    except ImportError:  # Windows: no lock
        return None
    flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    try:  # O_NOFOLLOW, O_NONBLOCK: a link or a pipe planted as .lock fails here, never hangs
        fd = os.open(os.path.join(out, ".lock"), flags, 0o644)
    except OSError as e:
        raise TrainingError(f"cannot open {os.path.join(out, '.lock')} ({e.strerror}); remove "
                            "it") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.fstat(fd).st_ino != os.stat(os.path.join(out, ".lock")).st_ino:  # removed meanwhile
            raise OSError(errno.EAGAIN, "a run ended as this one began")  # by a run that ended
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN, errno.ENOENT):
            raise TrainingError(f"another train.py is running in --out_dir {out}; wait for it to "
                                "finish or choose another --out_dir") from None
        raise TrainingError(f"cannot lock --out_dir {out} ({e.strerror}); its file system may not "
                            "support locks: choose a local --out_dir") from None
    return fd


def release_out_dir(out, lock, created):
    """Remove .lock if empty (a run's: one with something in it is not ours) and out_dir if this
    run made it and left it empty; then let go of the lock."""
    with suppress(OSError):  # a folder made read-only: the error that stopped the run is the one
        if lock is not None and os.path.getsize(os.path.join(out, ".lock")) == 0:  # to report
            os.remove(os.path.join(out, ".lock"))
        if created and not os.listdir(out):
            os.rmdir(out)
    if lock is not None:
        os.close(lock)
