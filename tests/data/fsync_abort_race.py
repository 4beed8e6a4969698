#!/usr/bin/env python3
"""Does a successful fdatasync survive an ext4 journal abort that races it?

Needs root. Each trial makes a fresh 64 MiB ext4 image, mounts it through a
loop device with errors=remount-ro, appends 512-byte records with
pwrite + fdatasync in one thread (optionally followed by a size change of a
probe file, as stateseal's sled ledger does), raises a filesystem error with
ext4's trigger_fs_error switch in sysfs after 0.2 s, then unmounts, mounts
again and checks that everything acknowledged is on disk.

    python3 tests/data/fsync_abort_race.py --trials 30            # fdatasync only
    python3 tests/data/fsync_abort_race.py --trials 60 --probe    # + the probe

Prints one line per trial that lost an acknowledged record, then a summary.
"""
import argparse
import os
import subprocess
import tempfile
import threading
import time

RECORD = 512


def record(off):
    return (b"%08d" % off) * (RECORD // 8)


def trial(img, mnt, probe):
    subprocess.run(["truncate", "-s", "64M", img], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", img, mnt], check=True)
    dev = subprocess.run(["findmnt", "-n", "-o", "SOURCE", mnt], capture_output=True,
                         text=True, check=True).stdout.strip().rsplit("/", 1)[-1]
    fd = os.open(os.path.join(mnt, "log"), os.O_RDWR | os.O_CREAT)
    pfd = os.open(os.path.join(mnt, "probe"), os.O_RDWR | os.O_CREAT)
    acked = [0]
    stop = [False]

    def writer():
        off = 0
        while not stop[0]:
            try:
                os.pwrite(fd, record(off), off)
                os.fdatasync(fd)
                if probe:
                    os.ftruncate(pfd, (off // RECORD + 1) % 2)
            except OSError:
                return
            off += RECORD
            acked[0] = off

    t = threading.Thread(target=writer)
    t.start()
    time.sleep(0.2)
    with open(f"/sys/fs/ext4/{dev}/trigger_fs_error", "w") as f:
        f.write("fsync_abort_race")
    time.sleep(0.1)
    stop[0] = True
    t.join()
    os.close(fd)
    os.close(pfd)
    subprocess.run(["umount", mnt], check=True)
    subprocess.run(["mount", "-o", "loop", img, mnt], check=True)
    with open(os.path.join(mnt, "log"), "rb") as f:
        data = f.read()
    subprocess.run(["umount", mnt], check=True)
    want = b"".join(record(o) for o in range(0, acked[0], RECORD))
    return acked[0], len(data), data[: acked[0]] == want


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--probe", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        img, mnt = os.path.join(d, "fs.img"), os.path.join(d, "mnt")
        os.mkdir(mnt)
        lost = 0
        for i in range(a.trials):
            acked, on_disk, ok = trial(img, mnt, a.probe)
            if not ok:
                lost += 1
                print(f"trial {i}: acknowledged {acked} bytes, {on_disk} on disk: LOST")
        mode = "fdatasync + probe" if a.probe else "fdatasync only"
        print(f"{mode}: {lost} of {a.trials} trials lost an acknowledged record")


if __name__ == "__main__":
    main()
