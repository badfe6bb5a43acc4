package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// Results is every figure of one run; results.json is this struct.
type Results struct {
	// Command is the command line that produced the run.
	Command string    `json:"command"`
	Started time.Time `json:"started"`
	// Seconds is the wall time of the whole run.
	Seconds float64 `json:"seconds"`
	Machine Machine `json:"machine"`
	// RTTByRep is the loopback round trip measured at the start of each
	// repetition.
	RTTByRep   []Latency `json:"ping_rtt_by_rep"`
	Profile    Profile   `json:"profile"`
	Contenders []string  `json:"contenders"`
	Scenarios  []string  `json:"scenarios"`
	A          []ARun    `json:"a_contended"`
	B          []BRun    `json:"b_uncontended"`
	C          []CRun    `json:"c_many_waiters"`
	D          []DRun    `json:"d_handoff_latency"`
	F          []FRun    `json:"f_renewals"`
	G          []GRun    `json:"g_memory_per_waiter"`
	// Failures lists the cells that could not run, with the reason.
	Failures []string `json:"failures"`
	// Targets checks leash's figures against the targets.
	Targets []Target `json:"targets"`
	// Plots are the plot files written next to results.md.
	Plots []string `json:"plots"`
}

// writeOutputs writes results.md, results.json and the plots into dir and returns
// the markdown.
func writeOutputs(dir string, res *Results) (string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	res.Targets = evaluateTargets(res)
	plots, err := writePlots(dir, res)
	if err != nil {
		return "", fmt.Errorf("plots: %w", err)
	}
	res.Plots = plots
	md := markdown(res)
	if err := os.WriteFile(filepath.Join(dir, "results.md"), []byte(md), 0o644); err != nil {
		return "", err
	}
	js, err := json.MarshalIndent(res, "", "  ")
	if err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, "results.json"), append(js, '\n'), 0o644); err != nil {
		return "", err
	}
	return md, nil
}

// ---- number formatting ----

// fmtSum renders a summary as "median [min–max]" with f, or "–" when empty.
func fmtSum(s Summary, f func(float64) string) string {
	if s.N == 0 {
		return "–"
	}
	if s.N == 1 || s.Min == s.Max {
		return f(s.Median)
	}
	return fmt.Sprintf("%s [%s–%s]", f(s.Median), f(s.Min), f(s.Max))
}

// fmtCount renders x with no decimals and thousands separators.
func fmtCount(x float64) string {
	if math.IsNaN(x) {
		return "–"
	}
	neg := x < 0
	s := fmt.Sprintf("%.0f", math.Abs(x))
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	if neg {
		s = "-" + s
	}
	return s
}

// fmtUs renders microseconds in µs, ms or s.
func fmtUs(us float64) string {
	a := math.Abs(us)
	switch {
	case math.IsNaN(us):
		return "–"
	case a < 10:
		return fmt.Sprintf("%.1f µs", us)
	case a < 1000:
		return fmt.Sprintf("%.0f µs", us)
	case a < 10000:
		return fmt.Sprintf("%.2f ms", us/1e3)
	case a < 1e6:
		return fmt.Sprintf("%.0f ms", us/1e3)
	default:
		return fmt.Sprintf("%.2f s", us/1e6)
	}
}

// fmtF returns a formatter with the given decimals.
func fmtF(decimals int) func(float64) string {
	return func(x float64) string { return fmt.Sprintf("%.*f", decimals, x) }
}

// fmtBytes renders a byte count.
func fmtBytes(b float64) string {
	if math.Abs(b) < 10*1024 {
		return fmt.Sprintf("%.0f B", b)
	}
	return fmt.Sprintf("%.1f KiB", b/1024)
}

// nanIf returns NaN when cond holds, else x: a run where a figure is undefined
// (no samples, nothing acquired) is left out of the summary.
func nanIf(cond bool, x float64) float64 {
	if cond {
		return math.NaN()
	}
	return x
}

// ---- run selection ----

// where returns the elements of xs that keep accepts, in order.
func where[T any](xs []T, keep func(T) bool) []T {
	var out []T
	for _, x := range xs {
		if keep(x) {
			out = append(out, x)
		}
	}
	return out
}

func aRuns(res *Results, contender string, g int) []ARun {
	return where(res.A, func(r ARun) bool { return r.Contender == contender && r.G == g })
}

func bRuns(res *Results, contender string) []BRun {
	return where(res.B, func(r BRun) bool { return r.Contender == contender })
}

func cRuns(res *Results, contender string, procs int) []CRun {
	return where(res.C, func(r CRun) bool { return r.Contender == contender && r.Procs == procs })
}

func dRuns(res *Results, contender string) []DRun {
	return where(res.D, func(r DRun) bool { return r.Contender == contender })
}

// dPooled returns the latency over every sample of the contender's D runs.
func dPooled(res *Results, contender string) Latency {
	var all []time.Duration
	for _, r := range dRuns(res, contender) {
		for _, us := range r.SamplesUs {
			all = append(all, time.Duration(us*float64(time.Microsecond)))
		}
	}
	return latencyOf(all)
}

// ---- the figures every table and plot shares ----

func aAcq(r ARun) float64     { return r.AcqPerSec }
func aChanges(r ARun) float64 { return r.ChangesPerSec }
func aP50(r ARun) float64     { return nanIf(r.Latency.Samples == 0, r.Latency.P50us) }
func aP99(r ARun) float64     { return nanIf(r.Latency.Samples == 0, r.Latency.P99us) }
func aJain(r ARun) float64    { return r.Jain }
func aStarved(r ARun) float64 { return float64(r.Starved) }
func aReq(r ARun) float64     { return nanIf(r.Acquisitions == 0, r.ReqPerAcq) }
func bOps(r BRun) float64     { return r.OpsPerSec }
func bP50(r BRun) float64     { return nanIf(r.Latency.Samples == 0, r.Latency.P50us) }
func bP99(r BRun) float64     { return nanIf(r.Latency.Samples == 0, r.Latency.P99us) }
func bReq(r BRun) float64     { return nanIf(r.Ops == 0, r.ReqPerOp) }
func cRate(r CRun) float64    { return nanIf(r.Acquired == 0, r.HandoffsPerSec) }
func cPct(r CRun) float64     { return nanIf(r.Acquired == 0, r.PercentOfLimit) }
func cGap(r CRun) float64     { return nanIf(r.Acquired == 0, r.IdleGapMs*1e3) }
func cReq(r CRun) float64     { return nanIf(r.Acquired == 0, r.ReqPerHandoff) }

// cDrainReq is the requests per handoff made from the holder's release on: the
// handoffs' own, without the waiters' queueing (their first attempts and joins,
// made while the holder held the lock).
func cDrainReq(r CRun) float64 {
	return nanIf(r.Acquired == 0, float64(r.Redis.Requests-r.Queueing.Requests)/float64(r.Acquired))
}

// cDrainReqNet is cDrainReq less the requests a process spends once, not per
// handoff: (un)subscribing and connection keep-alive PINGs.
func cDrainReqNet(r CRun) float64 {
	fixed := int64(0)
	for _, cmd := range []string{"subscribe", "psubscribe", "unsubscribe", "punsubscribe", "ping"} {
		fixed += r.Redis.ByCommand[cmd] - r.Queueing.ByCommand[cmd]
	}
	return nanIf(r.Acquired == 0, float64(r.Redis.Requests-r.Queueing.Requests-fixed)/float64(r.Acquired))
}
func cCmds(r CRun) float64  { return nanIf(r.Acquired == 0, r.CmdsPerHandoff) }
func cLimit(r CRun) float64 { return nanIf(r.Acquired == 0, r.LimitPerSec) }
func dP50(r DRun) float64   { return nanIf(r.Latency.Samples == 0, r.Latency.P50us) }

// rttP50 is the round trip the report compares with: the median of the
// repetitions' PING p50s (the one taken at start-up when no repetition ran).
func rttP50(res *Results) float64 {
	if s := summarizeBy(res.RTTByRep, func(l Latency) float64 { return l.P50us }); s.N > 0 {
		return s.Median
	}
	return res.Machine.RTT.P50us
}

// ---- markdown ----

// markdown renders the whole report.
func markdown(res *Results) string {
	var b strings.Builder
	w := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	m := res.Machine
	w("# leash benchmark results\n\n")
	w("Command: `%s`  \n", res.Command)
	w("Started %s, took %s (profile %q, %d repetitions).\n\n", res.Started.Format(time.RFC3339), time.Duration(res.Seconds*float64(time.Second)).Round(time.Second), res.Profile.Name, res.Profile.Reps)
	w("## Machine\n\n")
	w("| | |\n| --- | --- |\n")
	w("| nproc | %d (GOMAXPROCS %d) |\n", m.NumCPU, m.GOMAXPROCS)
	if m.CPUModel != "" {
		w("| CPU | %s |\n", m.CPUModel)
	}
	w("| Go | %s %s/%s |\n", m.GoVersion, m.GOOS, m.GOARCH)
	if m.LeashCommit != "" {
		w("| leash | commit %s |\n", m.LeashCommit)
	}
	server := "given with -addr"
	if m.OwnServer {
		server = "started by the harness (internal/testredis)"
	}
	w("| Redis | %s at %s, %s |\n", m.Redis, m.RedisAddr, server)
	w("| loopback round trip | PING p50 %s, p99 %s (%d sequential PINGs, at the start of each repetition; medians [min–max]) |\n\n",
		fmtSum(summarizeBy(res.RTTByRep, func(l Latency) float64 { return l.P50us }), fmtUs),
		fmtSum(summarizeBy(res.RTTByRep, func(l Latency) float64 { return l.P99us }), fmtUs), m.RTT.Samples)
	w("Figures are medians over the repetitions with [min–max]; every contender runs in every repetition of each scenario it takes part in, interleaved, the order rotated each time. ")
	w("*requests* = commands clients sent (a script call counts once); *server commands* also count the commands run inside scripts (see redisstats.go). ")
	w("leash also sends some of its scripts' commands itself (an uncontended release's HDEL and PUBLISH or LINDEX, a fair lock's uncontended LINDEX): it counts those, and they are added to its requests.\n\n")

	w("## Contenders\n\n| contender | scenarios | how a blocked Lock waits | commands run inside its scripts (not counted as requests) |\n| --- | --- | --- | --- |\n")
	for _, name := range res.Contenders {
		k, _ := kindByName(name)
		// "pubsub|numsub" (a subcommand's commandstats name) must not end the cell.
		w("| %s | %s | %s | %s |\n", k.name, scenarioLetters(k), k.waits, strings.ReplaceAll(strings.Join(k.scriptOnly, ", "), "|", `\|`))
	}
	w("\n")
	markdownScenarios(&b, res)
	markdownTargets(&b, res)
	if len(res.Failures) > 0 {
		w("## Failures\n\n")
		for _, f := range res.Failures {
			w("- %s\n", f)
		}
		w("\n")
	}
	if len(res.Plots) > 0 {
		w("## Plots\n\n")
		for _, p := range res.Plots {
			w("- [%s](%s)\n", p, p)
		}
		w("\n")
	}
	return b.String()
}

// scenarioLetters lists the scenarios k takes part in: A–E for most (E is read from
// A, C and D), with F and G for leash's Mutex, which runs them alone.
func scenarioLetters(k contenderKind) string {
	var out []string
	for _, s := range scenarioList {
		switch s.letter {
		case "E":
			if k.runsIn("A") || k.runsIn("C") || k.runsIn("D") {
				out = append(out, s.letter)
			}
		case "F", "G":
			if k.name == "leash" {
				out = append(out, s.letter)
			}
		default:
			if k.runsIn(s.letter) {
				out = append(out, s.letter)
			}
		}
	}
	return strings.Join(out, ", ")
}

// markdownScenarios renders one table per scenario that ran.
func markdownScenarios(b *strings.Builder, res *Results) {
	w := func(format string, a ...any) { fmt.Fprintf(b, format, a...) }
	p := res.Profile
	if len(res.A) > 0 {
		w("## A contended\n\nG goroutines of one process on one lock, zero hold time, %s per cell. ", p.ADuration)
		w("Latency is of the Lock calls that acquired; a goroutine still waiting when the cell ends adds no sample (see *starved*).\n\n")
		w("*Client CPU, allocs and goroutines* are the harness process's per acquisition (the contender's client plus the harness loop, the same for all).\n\n")
		w("| contender | G | acquisitions/s | owner changes/s | p50 | p99 | Jain | starved | requests/acq | client CPU/acq | allocs/acq | goroutines/acq |\n")
		w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		for _, g := range p.AGoroutines {
			for _, c := range res.Contenders {
				rs := aRuns(res, c, g)
				if len(rs) == 0 {
					continue
				}
				w("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", c, g,
					fmtSum(summarizeBy(rs, aAcq), fmtCount), fmtSum(summarizeBy(rs, aChanges), fmtCount),
					fmtSum(summarizeBy(rs, aP50), fmtUs), fmtSum(summarizeBy(rs, aP99), fmtUs),
					fmtSum(summarizeBy(rs, aJain), fmtF(3)), fmtSum(summarizeBy(rs, aStarved), fmtCount),
					fmtSum(summarizeBy(rs, aReq), fmtF(2)),
					fmtSum(summarizeBy(rs, func(r ARun) float64 { return nanIf(r.Acquisitions == 0, r.Client.CPUPerOpUs) }), fmtUs),
					fmtSum(summarizeBy(rs, func(r ARun) float64 { return nanIf(r.Acquisitions == 0, r.Client.AllocsPerOp) }), fmtF(0)),
					fmtSum(summarizeBy(rs, func(r ARun) float64 { return nanIf(r.Acquisitions == 0, r.Client.GoroutinesPerOp) }), fmtF(2)))
			}
		}
		w("\n")
	}
	if len(res.B) > 0 {
		w("## B uncontended\n\n%d goroutines, each on its own lock, lock+unlock cycles for %s per cell.\n\n", p.BGoroutines, p.BDuration)
		w("| contender | ops/s | cycle p50 | cycle p99 | requests/op | client CPU/op | allocs/op | goroutines/op |\n")
		w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		for _, c := range res.Contenders {
			rs := bRuns(res, c)
			if len(rs) == 0 {
				continue
			}
			w("| %s | %s | %s | %s | %s | %s | %s | %s |\n", c, fmtSum(summarizeBy(rs, bOps), fmtCount),
				fmtSum(summarizeBy(rs, bP50), fmtUs), fmtSum(summarizeBy(rs, bP99), fmtUs), fmtSum(summarizeBy(rs, bReq), fmtF(2)),
				fmtSum(summarizeBy(rs, func(r BRun) float64 { return nanIf(r.Ops == 0, r.Client.CPUPerOpUs) }), fmtUs),
				fmtSum(summarizeBy(rs, func(r BRun) float64 { return nanIf(r.Ops == 0, r.Client.AllocsPerOp) }), fmtF(0)),
				fmtSum(summarizeBy(rs, func(r BRun) float64 { return nanIf(r.Ops == 0, r.Client.GoroutinesPerOp) }), fmtF(2)))
		}
		w("\n")
	}
	if len(res.C) > 0 {
		w("## C many waiters\n\n%d waiters queue behind a holder that holds %s, then each takes the lock once, holding ~%s; ", p.CWaiters, p.CHolderHold, p.CHold)
		w("from 1 process and spread over several worker processes. Physical limit = 1 / (mean hold + one round trip); idle gap = (drain − sum of holds) / handoffs.")
		if p.CDrainCap > 0 {
			w(" A drain is capped at about %s after the holder's release: the waiters still waiting then stop, and the figures cover the handoffs made until then (*served*: waiters that got the lock).", p.CDrainCap)
		}
		w(" *Requests/handoff* counts every request of the cell, the waiters' queueing included; *in the drain* counts only those made from the holder's release on (the harness reads Redis's counters just before it tells the holder to release).")
		w("\n\n| contender | processes | served | handoffs/s | %% of limit | idle gap/handoff | requests/handoff | in the drain | server cmds/handoff | limit/s |\n")
		w("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		for _, procs := range p.CProcs {
			for _, c := range res.Contenders {
				rs := cRuns(res, c, procs)
				if len(rs) == 0 {
					continue
				}
				w("| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s |\n", c, procs,
					fmtSum(summarizeBy(rs, func(r CRun) float64 { return float64(r.Acquired) }), fmtCount), fmtSum(summarizeBy(rs, cRate), fmtCount),
					fmtSum(summarizeBy(rs, cPct), fmtF(1)), fmtSum(summarizeBy(rs, cGap), fmtUs),
					fmtSum(summarizeBy(rs, cReq), fmtF(2)), fmtSum(summarizeBy(rs, cDrainReq), fmtF(3)), fmtSum(summarizeBy(rs, cCmds), fmtF(2)),
					fmtSum(summarizeBy(rs, cLimit), fmtCount))
			}
		}
		w("\n")
		short := false
		for _, r := range res.C {
			if r.Acquired < r.Waiters {
				short = true
				why := ""
				switch {
				case r.Aborted:
					why = fmt.Sprintf(": nothing moved for %s, the rest were told to give up", cStall)
				case r.Capped:
					why = fmt.Sprintf(" within the drain cap; %d stopped waiting", r.Stopped)
				}
				firstErr := ""
				if r.FirstError != "" {
					firstErr = fmt.Sprintf(" (first error: %s)", r.FirstError)
				}
				procs := fmt.Sprintf("%d processes", r.Procs)
				if r.Procs == 1 {
					procs = "1 process"
				}
				w("- %s, %s, rep %d: %d of %d waiters acquired%s%s.\n",
					r.Contender, procs, r.Rep+1, r.Acquired, r.Waiters, why, firstErr)
			}
		}
		if short {
			w("\n")
		}
	}
	if len(res.D) > 0 {
		rtt := rttP50(res)
		w("## D handoff latency\n\nOne waiter in a second client; from the holder's Unlock returning to the waiter's Lock returning. ")
		if p := res.Profile; p.DDuration > 0 {
			rounds, n, dur := p.dRound()
			if rounds > 1 {
				w("Each repetition takes its cells in %d rounds, the contenders in turn (the order rotated each round), each contender taking at least %d samples in a round and going on until it has run %s, so contenders that hand off fast have more samples, and every contender's are spread over the same stretch of time. ",
					rounds, n, dur)
			} else {
				w("Each repetition takes at least %d samples per contender and goes on until it has run %s, so contenders that hand off fast have more samples. ",
					n, dur)
			}
		}
		w("Percentiles over every sample of every repetition; the last column is the per-repetition p50.\n\n")
		w("| contender | samples | p50 | p99 | p50 in round trips | p50 per rep |\n| --- | ---: | ---: | ---: | ---: | ---: |\n")
		for _, c := range res.Contenders {
			rs := dRuns(res, c)
			if len(rs) == 0 {
				continue
			}
			l := dPooled(res, c)
			w("| %s | %d | %s | %s | %s | %s |\n", c, l.Samples, fmtUs(l.P50us), fmtUs(l.P99us),
				fmtF(1)(l.P50us/rtt), fmtSum(summarizeBy(rs, dP50), fmtUs))
		}
		w("\n")
	}
	if len(res.A) > 0 || len(res.C) > 0 || len(res.D) > 0 {
		w("## E safety\n\nMoments with two holders inside, over every run: A by an in-process atomic at each acquisition; ")
		w("C by putting every hold of every process (wall-clock acquire and release-start times) on one time line; D by the waiter returning before the release began. ")
		w("Errors are Lock/Unlock calls that failed for another reason than the end of a cell.\n\n")
		w("| contender | A violations | C violations | D violations | errors A / B / C / D |\n| --- | ---: | ---: | ---: | ---: |\n")
		for _, c := range res.Contenders {
			s := safetyOf(res, c)
			// "–" where the contender did not take part in the scenario.
			ran := func(runs, n int) string {
				if runs == 0 {
					return "–"
				}
				return strconv.Itoa(n)
			}
			w("| %s | %s | %s | %s | %s / %s / %s / %s |\n", c, ran(s.runsA, s.a), ran(s.runsC, s.c), ran(s.runsD, s.d),
				ran(s.runsA, s.errA), ran(s.runsB, s.errB), ran(s.runsC, s.errC), ran(s.runsD, s.errD))
		}
		w("\n")
	}
	if len(res.F) > 0 {
		f := res.F[0]
		w("## F renewals\n\nleash only: %d locks held under the watchdog (WatchdogTimeout %s, renewal period %s), measured over %d periods.\n\n",
			f.Locks, p.FWatchdog, p.FWatchdog/3, p.FPeriods)
		w("| requests/period | server cmds/period | client CPU/period | goroutines/held lock | heap/held lock | acquire all | lost |\n")
		w("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
		lost := 0
		for _, r := range res.F {
			lost += r.Lost
		}
		w("| %s | %s | %s | %s | %s | %s | %d |\n\n",
			fmtSum(summarizeBy(res.F, func(r FRun) float64 { return r.RequestsPerPeriod }), fmtF(1)),
			fmtSum(summarizeBy(res.F, func(r FRun) float64 { return r.CommandsPerPeriod }), fmtCount),
			fmtSum(summarizeBy(res.F, func(r FRun) float64 { return r.CPUPerPeriodMs * 1e3 }), fmtUs),
			fmtSum(summarizeBy(res.F, func(r FRun) float64 { return r.GoroutinesPerLock }), fmtF(4)),
			fmtSum(summarizeBy(res.F, func(r FRun) float64 { return r.HeapPerLockBytes }), fmtBytes),
			fmtSum(summarizeBy(res.F, func(r FRun) float64 { return r.AcquireSeconds * 1e6 }), fmtUs),
			lost)
	}
	if len(res.G) > 0 {
		w("## G memory per waiter\n\nleash only: %d waiters parked (Acquire's channel form: no goroutine per waiter) on one held lock; heap after GC, before and after.\n\n", p.GWaiters)
		w("| heap/parked waiter | goroutines/waiter | requests while parking |\n| ---: | ---: | ---: |\n")
		w("| %s | %s | %s |\n\n",
			fmtSum(summarizeBy(res.G, func(r GRun) float64 { return r.HeapPerWaiter }), fmtBytes),
			fmtSum(summarizeBy(res.G, func(r GRun) float64 { return r.GoroutinesPerWait }), fmtF(4)),
			fmtSum(summarizeBy(res.G, func(r GRun) float64 { return float64(r.Requests) }), fmtCount))
	}
}

// safety adds up one contender's violations and errors, and counts its runs of
// each scenario.
type safety struct {
	a, c, d                    int
	errA, errB, errC, errD     int
	runsA, runsB, runsC, runsD int
}

// safetyOf sums the contender's violations and errors over every run.
func safetyOf(res *Results, contender string) safety {
	var s safety
	for _, r := range res.A {
		if r.Contender == contender {
			s.runsA++
			s.a += int(r.Violations)
			s.errA += int(r.Errors)
		}
	}
	for _, r := range res.B {
		if r.Contender == contender {
			s.runsB++
			s.errB += int(r.Errors)
		}
	}
	for _, r := range res.C {
		if r.Contender == contender {
			s.runsC++
			s.c += r.Violations
			s.errC += r.Errors
		}
	}
	for _, r := range res.D {
		if r.Contender == contender {
			s.runsD++
			s.d += r.Violations
			s.errD += r.Errors
		}
	}
	return s
}
