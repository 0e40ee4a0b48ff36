"""The sampler: a small program of its own that samples a process's anonymous memory.

:mod:`hostmem.peak.sampler` runs this file as a script in a separate interpreter
(``python -I -S``: no site, no environment, no torch; about 15 ms to start), so that
sampling never waits for the GIL of the process under test. It may therefore import
nothing but the standard library's os, select, signal, sys and time, and nothing of
hostmem. It ignores SIGINT, SIGTERM and SIGHUP: a Ctrl-C at a terminal, or a CI
runner ending a job, signals every process of the group, and the tracker, not the
sampler, decides what an interrupt ends (the sampler still ends with its tracker,
whose exit closes its stdin).

Protocol, one line each way per command. Options come as ``key=value`` arguments
(``interval``, ``shmem``, ``children``, ``points``, ``rescan``, and ``cgroup`` with
``cgver`` for a memory cgroup to sample). On stdin the tracker
sends ``begin PID`` once, then ``snap`` or ``stop``; each command is answered with
one JSON line on stdout (see :meth:`Sampling.report`) after a fresh sample, and
``stop`` (or stdin closing) ends the program. A PID that cannot be read is answered
with ``error FILE: REASON`` instead.

Each sample reads ``/proc/PID/statm`` (kept open, one ``pread``): anonymous bytes
are resident minus shared, the counters /proc/PID/status prints as RssAnon, at a
fifth of its cost; with ``shmem=1`` it reads status for RssAnon + RssShmem. With
``children=1`` the sum covers every descendant found by a tree scan (by ppid, every
``rescan`` seconds), each process's proportional share (``Pss_Anon`` from smaps_rollup)
while there are several: pages a fork left shared count once. With ``cgroup=FOLDER`` a
sample is the group's own anonymous figure from memory.stat instead (``total_rss`` in v1, ``anon`` in v2, plus the
shmem figure with ``shmem=1``): every process in the group, each page once; the
processes counted are those seen in its cgroup.procs.
"""

import os
import select
import signal
import sys
import time

STAT_KEYS = {"1": (b"total_rss", b"total_shmem"), "2": (b"anon", b"shmem")}  # as hostmem.cgroup_sandbox


class Sampling:
    """State of one sampling run: open /proc files, the peak, the timeline."""

    def __init__(self, root, shmem, children, points, rescan, group=None, version="1"):
        self.root, self.shmem = root, shmem
        self.children, self.points, self.rescan_every = children, points, rescan
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.own_pid = os.getpid()
        self.fds = {}
        self.processes = 0
        self.unrelated = set()
        self.seen = set()
        self.peak = self.baseline = self.last = self.rss_peak = -1
        self.samples = 0
        self.t0 = self.peak_t = self.last_t = self.last_began = 0.0
        self.max_gap = self.max_gap_t = 0.0
        self.width = 0.005
        self.timeline = []
        self.bucket = [-1, 0.0, -1]
        self.next_rescan = self.cpu0 = 0.0
        self.priority = "normal"
        self.group, self.members = group, set()
        if group is not None:
            self.stat_fd = os.open(os.path.join(group, "memory.stat"), os.O_RDONLY)
            self.stat_keys = STAT_KEYS[version][: 2 if shmem else 1]
        self.open_pid(root)

    def open_pid(self, pid):
        """Open the /proc file of ``pid`` once; every sample then costs one pread."""
        name = "status" if self.shmem else "statm"
        self.fds[pid] = os.open(f"/proc/{pid}/{name}", os.O_RDONLY)
        self.seen.add(pid)
        self.processes += 1

    def read_pid(self, pid, fd):
        """Return (anonymous, resident) bytes of ``pid``, or None once it is gone."""
        try:
            data = os.pread(fd, 4096, 0)
        except OSError:
            return None
        if not data:
            return None
        if not self.shmem:
            fields = data.split()
            resident, shared = int(fields[1]), int(fields[2])
            return (resident - shared) * self.page, resident * self.page
        return self.status_field(data, b"RssAnon:") + self.status_field(data, b"RssShmem:"), self.status_field(
            data, b"VmRSS:"
        )

    @staticmethod
    def status_field(data, key):
        """Bytes of one ``Key: N kB`` line; 0 when absent (a zombie has no memory lines)."""
        at = data.find(key)
        if at < 0:
            return 0
        return int(data[at + len(key) : data.index(b"kB", at)]) * 1024

    def read_group(self):
        """Anonymous bytes charged to the memory cgroup (and its subgroups) now."""
        data = b"\n" + os.pread(self.stat_fd, 16384, 0)
        total = 0
        for key in self.stat_keys:
            at = data.find(b"\n" + key + b" ")
            if at >= 0:
                total += int(data[at + len(key) + 2 : data.index(b"\n", at + 1)])
        return total

    def read_shares(self, pid):
        """Proportional anonymous bytes of ``pid`` (``Pss_Anon``, with ``Pss_Shmem`` where
        asked, from smaps_rollup): a page a fork left shared counts once over its sharers.
        None where the file or the field cannot be read.

        Opened anew at each read (the read walks the mappings, the open costs little
        beside it): an open smaps_rollup keeps the memory it was opened on. A child that
        dash starts with vfork shares the shell's memory until its exec, so one found in
        that window was counted by the shell's figures for good, and a guard missed the
        peak of the program it ran (the grandchild test of tests/hostmem/test_guard_tree.py,
        6 runs of 12 beside two busy cores; none of 8 after)."""
        try:
            fd = os.open(f"/proc/{pid}/smaps_rollup", os.O_RDONLY)
            try:
                data = os.pread(fd, 4096, 0)
            finally:
                os.close(fd)
        except OSError:
            return None
        if b"Pss_Anon:" not in data:  # a kernel without it (before 5.7)
            return None
        return self.status_field(data, b"Pss_Anon:") + (self.status_field(data, b"Pss_Shmem:") if self.shmem else 0)

    def sample(self):
        """Read every tracked process (or the group) once and fold the sum into the figures.

        Several processes (a tree scan) are summed by proportional shares where the kernel
        gives them: a fork's child shares its parent's pages until it writes them, and
        each process's resident count holds them whole (a test that forks a child of a
        400 MiB process grew by 400 MiB without allocating a byte)."""
        began = time.monotonic()
        anon = 0
        shares = len(self.fds) > 1 and self.group is None
        for pid, fd in list(self.fds.items()):
            got = self.read_pid(pid, fd)
            if got is None:
                os.close(self.fds.pop(pid))
                continue
            share = self.read_shares(pid) if shares else None
            anon += got[0] if share is None else share
            if pid == self.root and got[1] > self.rss_peak:
                self.rss_peak = got[1]
        if self.group is not None:
            anon = self.read_group()
        now = time.monotonic()
        if self.samples == 0:
            self.t0, self.baseline, self.peak, self.last_t, self.last_began = began, anon, anon, began, began
            self.cpu0 = time.process_time()
        t = began - self.t0
        # The reads of two samples lie at most this far apart (this one's end, the last one's
        # start): a stall between taking the time and reading is counted, not hidden.
        if now - self.last_began > self.max_gap:
            self.max_gap, self.max_gap_t = now - self.last_began, now - self.t0
        self.last_t, self.last_began, self.last = now, began, anon
        self.samples += 1
        if anon > self.peak:
            self.peak, self.peak_t = anon, t
        self.add_point(t, anon)

    def add_point(self, t, value):
        """Keep the largest value per time bucket; widen buckets to stay under ``points``."""
        index = int(t / self.width)
        if index == self.bucket[0]:
            if value > self.bucket[2]:
                self.bucket[1], self.bucket[2] = t, value
            return
        if self.bucket[0] >= 0:
            self.timeline.append((self.bucket[1], self.bucket[2]))
        self.bucket = [index, t, value]
        if len(self.timeline) >= self.points:
            self.width *= 2
            merged = []
            for point in self.timeline:
                if merged and int(merged[-1][0] / self.width) == int(point[0] / self.width):
                    if point[1] > merged[-1][1]:
                        merged[-1] = point
                else:
                    merged.append(point)
            self.bucket[0] = int(self.bucket[1] / self.width)
            if merged and int(merged[-1][0] / self.width) == self.bucket[0]:
                last_t, last_v = merged.pop()
                if last_v >= self.bucket[2]:
                    self.bucket[1], self.bucket[2] = last_t, last_v
            self.timeline = merged

    def rescan(self, now):
        """Find new descendants of the root: /proc entries not seen before, by ppid.

        In a memory cgroup the group's own list of processes says who is counted.
        """
        if now < self.next_rescan:
            return
        self.next_rescan = now + self.rescan_every
        if self.group is not None:
            self.scan_group()
            return
        present = {int(n) for n in os.listdir("/proc") if n.isdigit()}
        self.unrelated &= present
        self.seen &= present
        parents = {}
        for pid in present - self.unrelated - self.seen:
            try:
                with open(f"/proc/{pid}/stat", "rb") as handle:
                    parents[pid] = int(handle.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
        tree = set(self.fds) | {self.root}
        changed = True
        while changed:
            changed = False
            for pid, ppid in list(parents.items()):
                if ppid in tree and pid != self.own_pid:
                    tree.add(pid)
                    del parents[pid]
                    changed = True
                    try:
                        self.open_pid(pid)
                    except OSError:
                        pass
        self.unrelated.update(parents)

    def scan_group(self):
        """Add the processes now in the group to those counted (a gone group adds none)."""
        try:
            with open(os.path.join(self.group, "cgroup.procs"), "rb") as handle:
                self.members.update(int(pid) for pid in handle.read().split())
        except OSError:
            return
        self.processes = max(len(self.members), 1)

    def report(self):
        """One JSON line (written by hand: importing json costs the sampler 7 ms)."""
        points = self.timeline + ([(self.bucket[1], self.bucket[2])] if self.bucket[0] >= 0 else [])
        line = ",".join("[%.6f,%d]" % point for point in points)
        return (
            '{"peak": %d, "peak_t": %.6f, "baseline": %d, "last": %d, "samples": %d, "t0": %.6f,'
            ' "duration": %.6f, "max_gap": %.6f, "max_gap_t": %.6f, "rss_peak": %d, "processes": %d, "cpu_s": %.6f,'
            ' "priority": "%s", "timeline": [%s]}\n'
            % (
                self.peak, self.peak_t, self.baseline, self.last, self.samples, self.t0,
                self.last_t - self.t0, self.max_gap, self.max_gap_t, self.rss_peak, self.processes,
                time.process_time() - self.cpu0, self.priority, line,
            )
        ).encode()


def raise_priority():
    """Ask for the highest priority allowed, so that busy CPUs do not starve the sampler.

    SCHED_FIFO (needs CAP_SYS_NICE or an RLIMIT_RTPRIO) wakes it within ~1 ms even
    with every core busy; nice -10 still lets a busy core delay it by 20 ms. The
    sampler sleeps between samples, so the real-time class costs others ~3% of a core.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        return "fifo"
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice-10"
    except OSError:
        return "normal"


def main():
    """Sample until told to stop: ``begin PID``, then ``snap`` or ``stop`` on stdin."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    opts = dict(arg.split("=", 1) for arg in sys.argv[1:])
    priority = raise_priority()
    buffer = b""
    while b"\n" not in buffer:
        chunk = os.read(0, 4096)
        if not chunk:
            return
        buffer += chunk
    line, buffer = buffer.split(b"\n", 1)
    root = int(line.split()[1])
    interval = float(opts["interval"])
    try:
        state = Sampling(
            root, opts["shmem"] == "1", opts["children"] == "1", int(opts["points"]), float(opts["rescan"]),
            opts.get("cgroup"), opts.get("cgver", "1"),
        )
    except OSError as exc:
        os.write(1, ("error %s: %s\n" % (exc.filename or "/proc/%d" % root, exc.strerror or exc)).encode())
        return
    state.priority = priority
    if state.children or state.group is not None:
        state.rescan(time.monotonic())
    state.sample()
    os.write(1, state.report())
    while True:
        ready = b"\n" in buffer or select.select([0], [], [], interval)[0]
        if state.children or state.group is not None:
            state.rescan(time.monotonic())
        state.sample()
        if not ready:
            continue
        if b"\n" not in buffer:
            chunk = os.read(0, 4096)
            if not chunk:
                return
            buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            os.write(1, state.report())
            if line.strip() == b"stop":
                return


if __name__ == "__main__":
    main()
