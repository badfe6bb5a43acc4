package main

import (
	"math"
	"runtime"
	"runtime/metrics"
	"slices"
	"time"
)

// Summary is one figure over the repetitions: its median, min and max.
type Summary struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
	// N is how many repetitions had the figure (NaNs are left out).
	N int `json:"n"`
}

// summarize returns the median, min and max of xs, ignoring NaNs (figures a run
// did not have); with none left it returns the zero Summary (N == 0). The median of an
// even count is the mean of the two middle values.
func summarize(xs []float64) Summary {
	v := make([]float64, 0, len(xs))
	for _, x := range xs {
		if !math.IsNaN(x) {
			v = append(v, x)
		}
	}
	if len(v) == 0 {
		return Summary{}
	}
	slices.Sort(v)
	med := v[len(v)/2]
	if len(v)%2 == 0 {
		med = (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	return Summary{Median: med, Min: v[0], Max: v[len(v)-1], N: len(v)}
}

// summarizeBy summarizes f over runs.
func summarizeBy[T any](runs []T, f func(T) float64) Summary {
	xs := make([]float64, len(runs))
	for i, r := range runs {
		xs[i] = f(r)
	}
	return summarize(xs)
}

// percentile returns the p-th percentile (0 < p <= 100) of sorted by the
// nearest-rank method: the smallest sample with at least p% of the samples at or
// below it. It returns 0 for no samples.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(math.Ceil(p / 100 * float64(len(sorted))))
	rank = max(1, min(rank, len(sorted)))
	return sorted[rank-1]
}

// Latency is a latency distribution's headline figures, in microseconds.
type Latency struct {
	Samples int     `json:"samples"`
	P50us   float64 `json:"p50_us"`
	P99us   float64 `json:"p99_us"`
	Maxus   float64 `json:"max_us"`
	Meanus  float64 `json:"mean_us"`
}

// latencyOf sorts samples in place and returns its figures (all zero, with
// Samples == 0, when there are none).
func latencyOf(samples []time.Duration) Latency {
	if len(samples) == 0 {
		return Latency{}
	}
	slices.Sort(samples)
	var sum time.Duration
	for _, s := range samples {
		sum += s
	}
	return Latency{
		Samples: len(samples),
		P50us:   micros(percentile(samples, 50)),
		P99us:   micros(percentile(samples, 99)),
		Maxus:   micros(samples[len(samples)-1]),
		Meanus:  micros(sum) / float64(len(samples)),
	}
}

// micros returns d in (fractional) microseconds.
func micros(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// jain returns Jain's fairness index of counts: (sum x)^2 / (n * sum x^2). It is 1
// when every goroutine got the same share and 1/n when one got everything; 0 when
// nobody got anything.
func jain(counts []int64) float64 {
	var sum, sq float64
	for _, c := range counts {
		x := float64(c)
		sum += x
		sq += x * x
	}
	if sq == 0 {
		return 0
	}
	return sum * sum / (float64(len(counts)) * sq)
}

// starved returns how many of counts are zero.
func starved(counts []int64) int {
	n := 0
	for _, c := range counts {
		if c == 0 {
			n++
		}
	}
	return n
}

// perOp returns total/ops, or 0 when ops is zero. (Results hold no NaN, which
// JSON cannot carry; the report leaves such runs out of its summaries.)
func perOp(total float64, ops int64) float64 {
	if ops == 0 {
		return 0
	}
	return total / float64(ops)
}

// ratePerSec returns n per second of d, or 0 when d is not positive.
func ratePerSec(n int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(n) / d.Seconds()
}

// interval is one hold seen by the holder, in wall-clock nanoseconds (Unix), which
// are comparable across the processes of one machine.
type interval struct {
	// Acquired is when Lock returned nil.
	Acquired int64 `json:"a"`
	// Released is when the holder called Unlock (the start of the release).
	Released int64 `json:"r"`
}

// overlaps counts the holds that began before an earlier-begun hold had started
// its release: each is one moment with two holders inside. A correct lock scores 0,
// since the next holder's Lock cannot return before the previous Unlock was sent.
func overlaps(holds []interval) int {
	s := slices.Clone(holds)
	slices.SortFunc(s, func(a, b interval) int {
		if a.Acquired != b.Acquired {
			if a.Acquired < b.Acquired {
				return -1
			}
			return 1
		}
		return 0
	})
	n := 0
	var end int64 = math.MinInt64
	for _, h := range s {
		if h.Acquired < end {
			n++
		}
		end = max(end, h.Released)
	}
	return n
}

// ClientCost is what the harness process spent per operation during a measured
// section: the contender's client plus the harness's own loop, which is the same
// for every contender (a context and a latency sample per operation).
type ClientCost struct {
	AllocsPerOp float64 `json:"allocs_per_op"`
	BytesPerOp  float64 `json:"bytes_per_op"`
	// GoroutinesPerOp counts goroutines started per operation.
	GoroutinesPerOp float64 `json:"goroutines_started_per_op"`
	// CPUPerOpUs is user+system CPU time per operation, in microseconds.
	CPUPerOpUs float64 `json:"cpu_us_per_op"`
}

// clientSnapshot is the process counters ClientCost is computed from.
type clientSnapshot struct {
	mallocs, bytes, goroutines uint64
	cpu                        time.Duration
}

// goroutinesCreated is the runtime/metrics name of the count of goroutines
// started since the program began.
const goroutinesCreated = "/sched/goroutines-created:goroutines"

// takeClientSnapshot reads the process counters.
func takeClientSnapshot() clientSnapshot {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s := []metrics.Sample{{Name: goroutinesCreated}}
	metrics.Read(s)
	var g uint64
	if s[0].Value.Kind() == metrics.KindUint64 {
		g = s[0].Value.Uint64()
	}
	return clientSnapshot{mallocs: ms.Mallocs, bytes: ms.TotalAlloc, goroutines: g, cpu: cpuTime()}
}

// costSince returns the cost per op since before.
func costSince(before clientSnapshot, ops int64) ClientCost {
	after := takeClientSnapshot()
	if ops == 0 {
		return ClientCost{}
	}
	n := float64(ops)
	return ClientCost{
		AllocsPerOp:     float64(after.mallocs-before.mallocs) / n,
		BytesPerOp:      float64(after.bytes-before.bytes) / n,
		GoroutinesPerOp: float64(after.goroutines-before.goroutines) / n,
		CPUPerOpUs:      micros(after.cpu-before.cpu) / n,
	}
}
