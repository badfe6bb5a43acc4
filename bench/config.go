package main

import (
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strings"
	"sync"
	"time"
)

// Profile sizes every scenario. The default profile finishes in a few minutes on a
// 2-core machine; the full one takes longer (more repetitions, longer cells, more
// samples).
type Profile struct {
	Name string `json:"name"`
	Reps int    `json:"reps"`
	// A: goroutine counts and the duration of each cell.
	AGoroutines []int         `json:"a_goroutines"`
	ADuration   time.Duration `json:"a_duration_ns"`
	// B: goroutines (each on its own lock) and the duration of each cell.
	BGoroutines int           `json:"b_goroutines"`
	BDuration   time.Duration `json:"b_duration_ns"`
	// C: waiters, process counts, the first holder's hold, each waiter's hold, and
	// the bound of each waiter's Lock.
	CWaiters    int           `json:"c_waiters"`
	CProcs      []int         `json:"c_processes"`
	CHolderHold time.Duration `json:"c_holder_hold_ns"`
	CHold       time.Duration `json:"c_hold_ns"`
	CTimeout    time.Duration `json:"c_timeout_ns"`
	// CDrainCap, when positive, ends a C cell that long after the harness told
	// the first holder to release:
	// the waiters still waiting stop, and the figures cover the handoffs made
	// until then. It bounds the slow polling peers' drains; the others finish
	// well within it.
	CDrainCap time.Duration `json:"c_drain_cap_ns"`
	// D: samples per contender, spread over the repetitions, at least; a
	// repetition's cell keeps taking samples until it also has run DDuration, so
	// a contender that hands off in microseconds gets more samples than one that
	// polls (redsync takes about 150 ms a sample) and its p99 is not just its few
	// slowest. DRounds is how many rounds a repetition takes its cells in, the
	// contenders interleaved (see scenario_d.go); 0 means 1, as before it was a
	// field.
	DSamples  int           `json:"d_samples"`
	DDuration time.Duration `json:"d_duration_ns"`
	DRounds   int           `json:"d_rounds,omitempty"`
	// F: held locks, their watchdog timeout, and how many renewal periods are
	// measured.
	FLocks    int           `json:"f_locks"`
	FWatchdog time.Duration `json:"f_watchdog_ns"`
	FPeriods  int           `json:"f_periods"`
	// G: parked waiters.
	GWaiters int `json:"g_waiters"`
	// Pings is how many sequential PINGs measure the round trip.
	Pings int `json:"pings"`
}

// defaultProfile is what "go run ." runs: under 5 minutes on a 2-core machine.
func defaultProfile() Profile {
	return Profile{
		Name:        "default",
		Reps:        3,
		AGoroutines: []int{1, 16, 256},
		ADuration:   time.Second,
		BGoroutines: 256,
		BDuration:   500 * time.Millisecond,
		CWaiters:    1000,
		CProcs:      []int{1, 10},
		CHolderHold: 200 * time.Millisecond,
		CHold:       time.Millisecond,
		CTimeout:    60 * time.Second,
		CDrainCap:   5 * time.Second,
		DSamples:    200,
		DDuration:   1500 * time.Millisecond,
		DRounds:     5,
		FLocks:      10000,
		FWatchdog:   3 * time.Second,
		FPeriods:    2,
		GWaiters:    10000,
		Pings:       1000,
	}
}

// dRound returns how a repetition takes scenario D: in rounds rounds, each
// contender taking at least samples samples and running at least dur in each.
func (p Profile) dRound() (rounds, samples int, dur time.Duration) {
	rounds = max(p.DRounds, 1)
	perRep := (p.DSamples + p.Reps - 1) / max(p.Reps, 1)
	return rounds, (perRep + rounds - 1) / rounds, p.DDuration / time.Duration(rounds)
}

// fullProfile is what "go run . -full" runs.
func fullProfile() Profile {
	p := defaultProfile()
	p.Name = "full"
	p.Reps = 5
	p.AGoroutines = []int{1, 16, 256, 1024}
	p.ADuration = 3 * time.Second
	p.BDuration = 2 * time.Second
	p.CDrainCap = 0 // every contender drains all its waiters
	p.DSamples = 1000
	p.DDuration = 3 * time.Second
	p.FPeriods = 6
	p.Pings = 10000
	return p
}

// scenario names a scenario: its letter and its name as the report shows it.
type scenario struct{ letter, name string }

// scenarioList is every scenario, in report order. E (safety) is not run on its
// own: it is read from A, C and D.
var scenarioList = []scenario{
	{"A", "A contended"},
	{"B", "B uncontended"},
	{"C", "C many waiters"},
	{"D", "D handoff latency"},
	{"E", "E safety"},
	{"F", "F renewals"},
	{"G", "G memory per waiter"},
}

// selectScenarios parses the -scenarios filter: letters or names, comma
// separated; empty means all. Asking for E alone runs A and C, which E reads.
func selectScenarios(filter string) (map[string]bool, error) {
	set := map[string]bool{}
	if strings.TrimSpace(filter) == "" {
		for _, s := range scenarioList {
			set[s.letter] = true
		}
		return set, nil
	}
	for _, f := range strings.Split(filter, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		found := false
		for _, s := range scenarioList {
			if strings.EqualFold(f, s.letter) || strings.EqualFold(f, s.name) {
				set[s.letter], found = true, true
			}
		}
		if !found {
			return nil, fmt.Errorf("unknown scenario %q (have A..G or their names)", f)
		}
	}
	if set["E"] && !set["A"] && !set["C"] && !set["D"] {
		set["A"], set["C"] = true, true
	}
	return set, nil
}

// progress keeps one status line on stderr: the cell running, how many are done,
// and the time so far. On a terminal the line is redrawn in place.
type progress struct {
	mu    sync.Mutex
	w     io.Writer
	tty   bool
	total int
	done  int
	start time.Time
	last  string
}

// newProgress returns a progress line for total cells, written to w.
func newProgress(w io.Writer, total int) *progress {
	tty := false
	if f, ok := w.(*os.File); ok {
		if st, err := f.Stat(); err == nil && st.Mode()&os.ModeCharDevice != 0 {
			tty = true
		}
	}
	return &progress{w: w, tty: tty, total: total, start: time.Now()}
}

// step announces the next cell.
func (p *progress) step(label string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	el := time.Since(p.start).Round(time.Second)
	p.last = fmt.Sprintf("[%3d/%d %6s] %s", p.done, p.total, el, label)
	if p.tty {
		fmt.Fprintf(p.w, "\r\033[K%s", p.last)
	} else {
		fmt.Fprintln(p.w, p.last)
	}
}

// note prints a message on its own line, then redraws the status line.
func (p *progress) note(msg string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty {
		fmt.Fprintf(p.w, "\r\033[K%s\n%s", msg, p.last)
	} else {
		fmt.Fprintln(p.w, msg)
	}
}

// finish ends the status line.
func (p *progress) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty && p.last != "" {
		fmt.Fprintln(p.w)
	}
	fmt.Fprintf(p.w, "done: %d cells in %s\n", p.done, time.Since(p.start).Round(time.Second))
}

// startCPUProfile writes a CPU profile to path until the returned function is
// called.
func startCPUProfile(path string) (func(), error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() { pprof.StopCPUProfile(); f.Close() }, nil
}
