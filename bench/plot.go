package main

import (
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// Plots are dot plots drawn with gonum.org/v1/plot: one category per x position
// (a goroutine count, a contender), one series per colour, a dot at the median of
// the repetitions and a whisker from min to max. Latencies and rates span orders of
// magnitude between contenders, so most y axes are logarithmic.

// plotSeries is one colour of a dot plot: one Summary per category (N == 0: no
// dot).
type plotSeries struct {
	label string
	vals  []Summary
}

// dotPlotSpec describes one plot file.
type dotPlotSpec struct {
	file, title, xlabel, ylabel string
	cats                        []string
	log                         bool
	// label formats a y tick value (default: compact numbers, 2k, 10k).
	label func(float64) string
	// connect draws a line through each series' dots.
	connect bool
	series  []plotSeries
}

// rangeXYs are dots with min–max whiskers, for plotter.YErrorBars.
type rangeXYs struct {
	plotter.XYs
	plotter.YErrors
}

// drawDotPlot writes spec's plot into dir. It writes nothing and returns false when
// no series has a single dot to draw.
func drawDotPlot(dir string, spec dotPlotSpec) (bool, error) {
	p := plot.New()
	p.Title.Text = spec.title
	p.X.Label.Text = spec.xlabel
	p.Y.Label.Text = spec.ylabel
	p.NominalX(spec.cats...)
	p.Legend.Top = true
	p.Add(plotter.NewGrid())
	label := spec.label
	if label == nil {
		label = compactNumber
	}
	if spec.log {
		p.Y.Scale = plot.LogScale{}
		p.Y.Tick.Marker = logTicks{label: label}
	} else {
		p.Y.Tick.Marker = linearTicks{label: label}
	}
	n := len(spec.series)
	drawn := false
	lo, hi := math.Inf(1), math.Inf(-1)
	for i, s := range spec.series {
		off := 0.0
		if n > 1 {
			off = -0.25 + 0.5*float64(i)/float64(n-1)
		}
		var pts rangeXYs
		for j, v := range s.vals {
			if v.N == 0 || math.IsNaN(v.Median) || (spec.log && v.Min <= 0) {
				continue
			}
			pts.XYs = append(pts.XYs, plotter.XY{X: float64(j) + off, Y: v.Median})
			pts.YErrors = append(pts.YErrors, struct{ Low, High float64 }{v.Median - v.Min, v.Max - v.Median})
			lo, hi = math.Min(lo, v.Min), math.Max(hi, v.Max)
		}
		if len(pts.XYs) == 0 {
			continue
		}
		drawn = true
		sc, err := plotter.NewScatter(pts.XYs)
		if err != nil {
			return false, err
		}
		sc.GlyphStyle.Color = plotutil.Color(i)
		sc.GlyphStyle.Shape = plotutil.Shape(i)
		sc.GlyphStyle.Radius = vg.Points(3)
		eb, err := plotter.NewYErrorBars(pts)
		if err != nil {
			return false, err
		}
		eb.LineStyle.Color = plotutil.Color(i)
		p.Add(sc, eb)
		if spec.connect && len(pts.XYs) > 1 {
			ln, err := plotter.NewLine(pts.XYs)
			if err != nil {
				return false, err
			}
			ln.LineStyle.Color = plotutil.Color(i)
			ln.LineStyle.Dashes = plotutil.Dashes(i)
			p.Add(ln)
			p.Legend.Add(s.label, sc, ln)
		} else {
			p.Legend.Add(s.label, sc)
		}
	}
	if !drawn {
		return false, nil
	}
	// NominalX labels the categories but leaves the range to the data: show every
	// category, whether or not it has a dot.
	p.X.Min, p.X.Max = -0.5, float64(len(spec.cats))-0.5
	// Leave room above the dots for the legend (top right), and a little below.
	if spec.log {
		span := math.Max(math.Log10(hi/lo), 0.5)
		p.Y.Min = lo / math.Pow(10, 0.08*span)
		p.Y.Max = hi * math.Pow(10, 0.45*span)
	} else {
		p.Y.Min = 0
		p.Y.Max = hi * 1.45
	}
	return true, p.Save(7*vg.Inch, 4.5*vg.Inch, filepath.Join(dir, spec.file))
}

// logTicks marks 1, 2 and 5 times each power of ten with a label, and the other
// integer multiples without one (with one too on a narrow axis): plot.LogTicks
// labels only the powers of ten, which leaves most of these plots with a single
// label.
type logTicks struct{ label func(float64) string }

// Ticks implements plot.Ticker.
func (t logTicks) Ticks(min, max float64) []plot.Tick {
	var ts []plot.Tick
	narrow := max/min < 20 // less than about a decade and a half: label every tick
	for e := math.Floor(math.Log10(min)); math.Pow(10, e) <= max; e++ {
		for m := 1.0; m < 10; m++ {
			v := m * math.Pow(10, e)
			if v < min || v > max {
				continue
			}
			tick := plot.Tick{Value: v}
			if narrow || m == 1 || m == 2 || m == 5 {
				tick.Label = t.label(v)
			}
			ts = append(ts, tick)
		}
	}
	return ts
}

// linearTicks is plot.DefaultTicks with labels from label.
type linearTicks struct{ label func(float64) string }

// Ticks implements plot.Ticker.
func (t linearTicks) Ticks(min, max float64) []plot.Tick {
	ts := plot.DefaultTicks{}.Ticks(min, max)
	for i := range ts {
		if ts[i].Label != "" {
			ts[i].Label = t.label(ts[i].Value)
		}
	}
	return ts
}

// compactNumber renders 2000 as "2k" and 3000000 as "3M".
func compactNumber(v float64) string {
	switch a := math.Abs(v); {
	case a >= 1e6:
		return strconv.FormatFloat(v/1e6, 'g', 3, 64) + "M"
	case a >= 1e3:
		return strconv.FormatFloat(v/1e3, 'g', 3, 64) + "k"
	default:
		return strconv.FormatFloat(v, 'g', 3, 64)
	}
}

// microsLabel renders a tick in microseconds as a time: 200µs, 5ms, 1s.
func microsLabel(us float64) string {
	switch a := math.Abs(us); {
	case a >= 1e6:
		return strconv.FormatFloat(us/1e6, 'g', 3, 64) + "s"
	case a >= 1e3:
		return strconv.FormatFloat(us/1e3, 'g', 3, 64) + "ms"
	default:
		return strconv.FormatFloat(us, 'g', 3, 64) + "µs"
	}
}

// writePlots draws every plot the results have data for and returns the file
// names written.
func writePlots(dir string, res *Results) ([]string, error) {
	var specs []dotPlotSpec
	if len(res.A) > 0 {
		// byG returns the categories (goroutine counts from minG) and one series
		// per contender.
		byG := func(minG int, f func(ARun) float64) ([]string, []plotSeries) {
			var cats []string
			ss := make([]plotSeries, len(res.Contenders))
			for i, c := range res.Contenders {
				ss[i].label = c
			}
			for _, g := range res.Profile.AGoroutines {
				if g < minG {
					continue
				}
				cats = append(cats, fmt.Sprintf("G=%d", g))
				for i, c := range res.Contenders {
					ss[i].vals = append(ss[i].vals, summarizeBy(aRuns(res, c, g), f))
				}
			}
			return cats, ss
		}
		spec := func(file, title, ylabel string, minG int, label func(float64) string, f func(ARun) float64) dotPlotSpec {
			cats, ss := byG(minG, f)
			return dotPlotSpec{file: file, title: title, xlabel: "goroutines on one lock", ylabel: ylabel,
				cats: cats, log: true, connect: true, label: label, series: ss}
		}
		specs = append(specs,
			spec("a_acquisitions.png", "A contended: acquisitions/s", "acquisitions/s", 1, nil, aAcq),
			// One goroutine never changes owner: start at G=2.
			spec("a_owner_changes.png", "A contended: owner changes/s", "owner changes/s", 2, nil, aChanges),
			spec("a_p99.png", "A contended: acquire latency p99", "p99 of Lock", 1, microsLabel, aP99))
	}
	// inScenario returns the contenders with runs in a scenario (has says whether
	// one has): the categories of a per-contender plot, so a contender that does
	// not take part leaves no empty slot.
	inScenario := func(has func(string) bool) []string {
		var cats []string
		for _, c := range res.Contenders {
			if has(c) {
				cats = append(cats, c)
			}
		}
		return cats
	}
	perContender := func(cats []string, label string, f func(string) Summary) plotSeries {
		s := plotSeries{label: label}
		for _, c := range cats {
			s.vals = append(s.vals, f(c))
		}
		return s
	}
	if len(res.B) > 0 {
		cats := inScenario(func(c string) bool { return len(bRuns(res, c)) > 0 })
		specs = append(specs, dotPlotSpec{file: "b_ops.png", title: "B uncontended: lock+unlock cycles/s",
			xlabel: "contender", ylabel: "ops/s", cats: cats, log: true,
			series: []plotSeries{perContender(cats, fmt.Sprintf("%d goroutines", res.Profile.BGoroutines),
				func(c string) Summary { return summarizeBy(bRuns(res, c), bOps) })}})
	}
	if len(res.C) > 0 {
		cats := inScenario(func(c string) bool {
			return slices.ContainsFunc(res.C, func(r CRun) bool { return r.Contender == c })
		})
		var ss []plotSeries
		for _, procs := range res.Profile.CProcs {
			label := fmt.Sprintf("%d processes", procs)
			if procs == 1 {
				label = "1 process"
			}
			ss = append(ss, perContender(cats, label, func(c string) Summary { return summarizeBy(cRuns(res, c, procs), cRate) }))
		}
		title := fmt.Sprintf("C many waiters: handoffs/s (%d waiters)", res.Profile.CWaiters)
		if capped := inScenario(func(c string) bool {
			return slices.ContainsFunc(res.C, func(r CRun) bool { return r.Contender == c && r.Capped })
		}); len(capped) > 0 {
			title += fmt.Sprintf("\n%s: drain capped at %s", strings.Join(capped, ", "), res.Profile.CDrainCap)
		}
		specs = append(specs, dotPlotSpec{file: "c_handoffs.png", title: title,
			xlabel: "contender", ylabel: "handoffs/s", cats: cats, series: ss})
	}
	if len(res.D) > 0 {
		cats := inScenario(func(c string) bool { return len(dRuns(res, c)) > 0 })
		pooled := func(pick func(Latency) float64) func(string) Summary {
			return func(c string) Summary {
				l := dPooled(res, c)
				if l.Samples == 0 {
					return Summary{}
				}
				v := pick(l)
				return Summary{Median: v, Min: v, Max: v, N: 1}
			}
		}
		specs = append(specs, dotPlotSpec{file: "d_latency.png", title: "D handoff latency (all samples)",
			xlabel: "contender", ylabel: "release → acquire", cats: cats, log: true, label: microsLabel,
			series: []plotSeries{
				perContender(cats, "p50", pooled(func(l Latency) float64 { return l.P50us })),
				perContender(cats, "p99", pooled(func(l Latency) float64 { return l.P99us })),
			}})
	}
	var files []string
	for _, s := range specs {
		ok, err := drawDotPlot(dir, s)
		if err != nil {
			return files, fmt.Errorf("%s: %w", s.file, err)
		}
		if ok {
			files = append(files, s.file)
		}
	}
	return files, nil
}
