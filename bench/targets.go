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
	Scenario string `json:"scenario"`
	Goal     string `json:"goal"`
	Measured string `json:"measured"`
	// Met is "yes", "no", or "n/a" when a figure it needs was not measured.
	Met string `json:"met"`
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

// evaluateTargets checks leash's medians against the targets. Without leash in
// the run there is nothing to check.
func evaluateTargets(res *Results) []Target {
	has := map[string]bool{}
	for _, c := range res.Contenders {
		has[c] = true
	}
	if !has["leash"] {
		return nil
	}
	var ts []Target
	add := func(scen, goal, measured string, met string) {
		ts = append(ts, Target{scen, goal, measured, met})
	}
	peers := []string{}
	for _, c := range res.Contenders {
		if c != "leash" {
			peers = append(peers, c)
		}
	}
	aMed := func(c string, g int, f func(ARun) float64) float64 {
		return median(summarizeBy(aRuns(res, c, g), f))
	}

	if len(res.A) > 0 {
		l, n := aMed("leash", 1, aAcq), aMed("naive", 1, aAcq)
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
			lc := aMed("leash", g, aChanges)
			add("A", fmt.Sprintf("G=%d: owner changes/s ≥ 5× best peer's", g),
				fmt.Sprintf("%s vs %s (%s): %.1f×", fmtCount(lc), fmtCount(best), bestName, lc/best), verdict(lc >= 5*best, lc, best))
			j := aMed("leash", g, aJain)
			add("A", fmt.Sprintf("G=%d: Jain ≥ 0.95", g), fmtF(3)(j), verdict(j >= 0.95, j))
			lp := aMed("leash", g, aP99)
			for _, p := range []string{"naive", "rueidislock"} {
				pp := aMed(p, g, aP99)
				add("A", fmt.Sprintf("G=%d: p99 ≤ 1/10 of %s's", g, p),
					fmt.Sprintf("%s vs %s", fmtUs(lp), fmtUs(pp)), verdict(lp <= pp/10, lp, pp))
			}
			worst := 0
			for _, r := range aRuns(res, "leash", g) {
				worst = max(worst, r.Starved)
			}
			add("A", fmt.Sprintf("G=%d: no goroutine starved", g), fmt.Sprintf("max %d starved", worst), verdict(worst == 0))
		}
	}
	if len(res.B) > 0 {
		l, q := median(summarizeBy(bRuns(res, "leash"), bOps)), median(summarizeBy(bRuns(res, "rueidislock"), bOps))
		add("B", "ops/s ≥ 1.5× rueidislock's", fmt.Sprintf("%s vs %s: %.2f×", fmtCount(l), fmtCount(q), l/q), verdict(l >= 1.5*q, l, q))
	}
	if len(res.C) > 0 {
		for _, procs := range res.Profile.CProcs {
			rs := cRuns(res, "leash", procs)
			pct, gap := median(summarizeBy(rs, cPct)), median(summarizeBy(rs, cGap))
			add("C", fmt.Sprintf("%d proc: ≥ 95%% of physical limit", procs), fmtF(1)(pct)+"%", verdict(pct >= 95, pct))
			add("C", fmt.Sprintf("%d proc: idle gap ≤ 0.1 ms per handoff", procs), fmtUs(gap), verdict(gap <= 100, gap))
			if procs == 1 {
				req := median(summarizeBy(rs, cReq))
				add("C", "1 proc: ≤ 2 requests per handoff", fmtF(2)(req), verdict(req <= 2, req))
			}
		}
	}
	if len(res.D) > 0 {
		l, q := dPooled(res, "leash"), dPooled(res, "rueidislock")
		rtt := rttP50(res)
		lp50, lp99, qp99 := nanIf(l.Samples == 0, l.P50us), nanIf(l.Samples == 0, l.P99us), nanIf(q.Samples == 0, q.P99us)
		add("D", "p50 ≤ 2 round trips", fmt.Sprintf("%s = %.1f RTT (RTT %s)", fmtUs(lp50), lp50/rtt, fmtUs(rtt)), verdict(lp50 <= 2*rtt, lp50))
		add("D", "p99 ≤ half of rueidislock's", fmt.Sprintf("%s vs %s", fmtUs(lp99), fmtUs(qp99)), verdict(lp99 <= qp99/2, lp99, qp99))
	}
	if len(res.A) > 0 || len(res.C) > 0 || len(res.D) > 0 {
		s := safetyOf(res, "leash")
		v := s.a + s.c + s.d
		add("E", "0 violations", fmt.Sprintf("%d (A %d, C %d, D %d)", v, s.a, s.c, s.d), verdict(v == 0))
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

// markdownTargets renders the targets table.
func markdownTargets(b *strings.Builder, res *Results) {
	if len(res.Targets) == 0 {
		return
	}
	met := 0
	for _, t := range res.Targets {
		if t.Met == "yes" {
			met++
		}
	}
	fmt.Fprintf(b, "## leash against its targets\n\n%d of %d met (medians).\n\n", met, len(res.Targets))
	b.WriteString("| scenario | target | measured | met |\n| --- | --- | --- | --- |\n")
	for _, t := range res.Targets {
		m := t.Met
		if m == "no" {
			m = "**no**"
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s |\n", t.Scenario, t.Goal, t.Measured, m)
	}
	b.WriteString("\n")
}
