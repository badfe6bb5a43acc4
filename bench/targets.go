package main

import (
	"fmt"
	"math"
	"strings"
)

// The issue sets leash targets relative to the peers and to physics. The harness
// checks them on medians and prints the outcome next to the tables, so a report
// never hides a miss.

// Target is one checked target.
type Target struct {
	// Contender is the leash contender checked: leash (the Mutex) or leash-fair.
	Contender string `json:"contender"`
	Scenario  string `json:"scenario"`
	Goal      string `json:"goal"`
	Measured  string `json:"measured"`
	// Met is "yes", "no", or "n/a" when a figure it needs was not measured.
	Met string `json:"met"`
}

// isPeer reports whether the contender is someone else's lock (or the naive one),
// not one of leash's: "best peer" never means leash's other lock.
func isPeer(contender string) bool {
	return contender != "leash" && contender != "leash-fair"
}

// verdict turns a comparison into Target.Met; NaN operands give "n/a".
func verdict(ok bool, operands ...float64) string {
	for _, x := range operands {
		if math.IsNaN(x) {
			return "n/a"
		}
	}
	if ok {
		return "yes"
	}
	return "no"
}

// median returns the median of s, or NaN when s is empty.
func median(s Summary) float64 {
	if s.N == 0 {
		return math.NaN()
	}
	return s.Median
}

// evaluateTargets checks the medians of leash's Mutex against every target, and
// those of leash's fair lock (leash-fair) against the targets of the scenarios it
// runs (A, C, D) plus the fair lock's own. A leash contender that is not in the run
// is not checked.
func evaluateTargets(res *Results) []Target {
	var ts []Target
	for _, c := range res.Contenders {
		if !isPeer(c) {
			ts = append(ts, targetsOf(res, c)...)
		}
	}
	return ts
}

// targetsOf checks one leash contender's medians against the targets.
func targetsOf(res *Results, who string) []Target {
	var ts []Target
	add := func(scen, goal, measured string, met string) {
		ts = append(ts, Target{who, scen, goal, measured, met})
	}
	var peers []string
	for _, c := range res.Contenders {
		if isPeer(c) {
			peers = append(peers, c)
		}
	}
	aMed := func(c string, g int, f func(ARun) float64) float64 {
		return median(summarizeBy(aRuns(res, c, g), f))
	}
	// s counts who's runs of each scenario, besides its violations (E).
	s := safetyOf(res, who)

	if s.runsA > 0 {
		l, n := aMed(who, 1, aAcq), aMed("naive", 1, aAcq)
		add("A", "G=1: acquisitions/s ≥ naive's", fmt.Sprintf("%s vs %s", fmtCount(l), fmtCount(n)), verdict(l >= n, l, n))
		for _, g := range res.Profile.AGoroutines {
			if g < 16 {
				continue
			}
			best, bestName := math.NaN(), ""
			for _, p := range peers {
				if v := aMed(p, g, aChanges); !math.IsNaN(v) && (math.IsNaN(best) || v > best) {
					best, bestName = v, p
				}
			}
			lc := aMed(who, g, aChanges)
			add("A", fmt.Sprintf("G=%d: owner changes/s ≥ 5× best peer's", g),
				fmt.Sprintf("%s vs %s (%s): %.1f×", fmtCount(lc), fmtCount(best), bestName, lc/best), verdict(lc >= 5*best, lc, best))
			j := aMed(who, g, aJain)
			add("A", fmt.Sprintf("G=%d: Jain ≥ 0.95", g), fmtF(3)(j), verdict(j >= 0.95, j))
			lp := aMed(who, g, aP99)
			for _, p := range []string{"naive", "rueidislock"} {
				pp := aMed(p, g, aP99)
				add("A", fmt.Sprintf("G=%d: p99 ≤ 1/10 of %s's", g, p),
					fmt.Sprintf("%s vs %s", fmtUs(lp), fmtUs(pp)), verdict(lp <= pp/10, lp, pp))
			}
			worst := 0
			for _, r := range aRuns(res, who, g) {
				worst = max(worst, r.Starved)
			}
			add("A", fmt.Sprintf("G=%d: no goroutine starved", g), fmt.Sprintf("max %d starved", worst), verdict(worst == 0))
		}
	}
	if s.runsB > 0 {
		l, q := median(summarizeBy(bRuns(res, who), bOps)), median(summarizeBy(bRuns(res, "rueidislock"), bOps))
		add("B", "ops/s ≥ 1.5× rueidislock's", fmt.Sprintf("%s vs %s: %.2f×", fmtCount(l), fmtCount(q), l/q), verdict(l >= 1.5*q, l, q))
	}
	if s.runsC > 0 {
		// oneProc is the requests per handoff from 1 process, which the request
		// targets from several processes are relative to.
		oneProc := median(summarizeBy(cRuns(res, who, 1), cReq))
		for _, procs := range res.Profile.CProcs {
			rs := cRuns(res, who, procs)
			pct, gap, req := median(summarizeBy(rs, cPct)), median(summarizeBy(rs, cGap)), median(summarizeBy(rs, cReq))
			add("C", fmt.Sprintf("%d proc: ≥ 95%% of physical limit", procs), fmtF(1)(pct)+"%", verdict(pct >= 95, pct))
			add("C", fmt.Sprintf("%d proc: idle gap ≤ 0.1 ms per handoff", procs), fmtUs(gap), verdict(gap <= 100, gap))
			if procs == 1 {
				add("C", "1 proc: ≤ 2 requests per handoff", fmtF(2)(req), verdict(req <= 2, req))
				continue
			}
			// Every process with waiters may spend one more request per handoff
			// than a lone process does (its woken waiter's attempt), no more.
			add("C", fmt.Sprintf("%d proc: requests per handoff ≤ 1 proc's + 1 per process with waiters", procs),
				fmt.Sprintf("%s vs %s + %d", fmtF(2)(req), fmtF(2)(oneProc), procs), verdict(req <= oneProc+float64(procs), req, oneProc))
			if who == "leash-fair" {
				// The target is about handoffs, so it is checked on the drain's
				// requests (from the holder's release on): every process must send
				// its waiters to the queue at least once, so the queueing's requests
				// grow with the processes whatever the design. Every process also
				// unsubscribes once per lock, and rueidis pings a connection that has
				// been idle for a second: costs per process, left out too. The
				// cell's whole count is shown beside it.
				net, net1 := median(summarizeBy(rs, cDrainReqNet)), median(summarizeBy(cRuns(res, who, 1), cDrainReqNet))
				add("C", fmt.Sprintf("fair lock: %d proc requests per handoff in the drain ≤ 1 proc's (less (un)subscribe and keep-alive PINGs)", procs),
					fmt.Sprintf("%s vs %s (whole cell, queueing included: %s vs %s)", fmtF(3)(net), fmtF(3)(net1), fmtF(3)(req), fmtF(3)(oneProc)),
					verdict(net <= net1, net, net1))
			}
		}
	}
	if s.runsD > 0 {
		l, q := dPooled(res, who), dPooled(res, "rueidislock")
		rtt := rttP50(res)
		lp50, lp99, qp99 := nanIf(l.Samples == 0, l.P50us), nanIf(l.Samples == 0, l.P99us), nanIf(q.Samples == 0, q.P99us)
		add("D", "p50 ≤ 2 round trips", fmt.Sprintf("%s = %.1f RTT (RTT %s)", fmtUs(lp50), lp50/rtt, fmtUs(rtt)), verdict(lp50 <= 2*rtt, lp50))
		add("D", "p99 ≤ half of rueidislock's", fmt.Sprintf("%s vs %s", fmtUs(lp99), fmtUs(qp99)), verdict(lp99 <= qp99/2, lp99, qp99))
	}
	if s.runsA+s.runsC+s.runsD > 0 {
		v := s.a + s.c + s.d
		add("E", "0 violations", fmt.Sprintf("%d (A %d, C %d, D %d)", v, s.a, s.c, s.d), verdict(v == 0))
	}
	if who != "leash" {
		return ts // F and G run leash's Mutex alone
	}
	if len(res.F) > 0 {
		var maxG float64
		for _, r := range res.F {
			maxG = max(maxG, float64(r.GoroutinesHeld-r.GoroutinesBefore))
		}
		add("F", "goroutines independent of held locks", fmt.Sprintf("+%.0f goroutines for %d held locks", maxG, res.F[0].Locks),
			verdict(maxG <= 16))
		req := median(summarizeBy(res.F, func(r FRun) float64 { return r.RequestsPerPeriod }))
		limit := float64(res.F[0].Locks) / 50
		add("F", "renewal requests per period ≤ held/50", fmt.Sprintf("%.1f ≤ %.0f", req, limit), verdict(req <= limit, req))
	}
	if len(res.G) > 0 {
		h := median(summarizeBy(res.G, func(r GRun) float64 { return r.HeapPerWaiter }))
		add("G", "≤ 1 KiB heap per parked waiter", fmtBytes(h), verdict(h <= 1024, h))
	}
	return ts
}

// markdownTargets renders one targets table per leash contender checked.
func markdownTargets(b *strings.Builder, res *Results) {
	for _, who := range res.Contenders {
		var ts []Target
		met := 0
		for _, t := range res.Targets {
			if t.Contender == who {
				ts = append(ts, t)
				if t.Met == "yes" {
					met++
				}
			}
		}
		if len(ts) == 0 {
			continue
		}
		title := "leash against its targets"
		if who != "leash" {
			title = who + " against the same targets (the scenarios it runs) and its own"
		}
		fmt.Fprintf(b, "## %s\n\n%d of %d met (medians).\n\n", title, met, len(ts))
		b.WriteString("| scenario | target | measured | met |\n| --- | --- | --- | --- |\n")
		for _, t := range ts {
			m := t.Met
			if m == "no" {
				m = "**no**"
			}
			fmt.Fprintf(b, "| %s | %s | %s | %s |\n", t.Scenario, t.Goal, t.Measured, m)
		}
		b.WriteString("\n")
	}
}
