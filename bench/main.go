// Command bench compares leash (its Mutex, and its fair lock as leash-fair in
// scenarios A, C and D) with the lock most services write by hand (naive) and with
// the Go peers (bsm/redislock, go-redsync/redsync, rueidis's rueidislock) on one
// Redis server, and writes the figures as results.md, results.json and PNG plots.
//
//	cd bench && go run . -out results
//
// Without -addr it starts its own redis-server on a free loopback port (through
// internal/testredis) and stops it on exit. Every contender runs in the same run
// (in each scenario it takes part in), interleaved within each repetition, with
// the contender order rotated from one repetition to the next; the report gives
// medians with [min–max] over the repetitions. The comment at the top of each
// scenario_*.go file says what that scenario measures and how; redisstats.go says
// how Redis work is counted.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/leash-go/leash/internal/testredis"
)

func main() {
	if os.Getenv(workerEnv) == "1" {
		os.Exit(workerMain(os.Stdin, os.Stdout))
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := mainErr(ctx, os.Args[1:])
	stop()
	testredis.StopAll()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// options are the parsed command line.
type options struct {
	addr       string
	out        string
	full       bool
	scenarios  string
	contenders string
	cpuprofile string
	// from, when set, is a results.json to render again instead of running.
	from string
	prof Profile
	args []string
}

// parseFlags parses the command line into options.
func parseFlags(args []string, stderr io.Writer) (options, error) {
	var o options
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.addr, "addr", "", "Redis `host:port` to use (default: start a redis-server on a free loopback port)")
	fs.StringVar(&o.out, "out", "results", "`dir`ectory for results.md, results.json and the plots")
	fs.BoolVar(&o.full, "full", false, "the full profile: more repetitions, longer cells, more samples")
	reps := fs.Int("reps", 0, "repetitions (default 3, or 5 with -full)")
	fs.StringVar(&o.scenarios, "scenarios", "", "comma list of scenarios to run, by letter or name (default all: A,B,C,D,E,F,G)")
	fs.StringVar(&o.contenders, "contenders", "", "comma list of contenders (default all: "+kindNames(allKinds)+")")
	fs.StringVar(&o.from, "from", "", "render results.md and the plots again from this `results.json` instead of running")
	fs.StringVar(&o.cpuprofile, "cpuprofile", "", "write a CPU profile of the harness process (leash's client side included) to `file`")
	if err := fs.Parse(args); err != nil {
		return o, err
	}
	if fs.NArg() > 0 {
		return o, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	o.prof = defaultProfile()
	if o.full {
		o.prof = fullProfile()
	}
	if *reps < 0 {
		return o, fmt.Errorf("-reps must be positive")
	}
	if *reps > 0 {
		o.prof.Reps = *reps
	}
	o.args = args
	return o, nil
}

// mainErr runs the harness as the command line says.
func mainErr(ctx context.Context, args []string) error {
	o, err := parseFlags(args, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return nil
	}
	if err != nil {
		return err
	}
	if o.from != "" {
		return rerender(o.from, o.out)
	}
	if o.cpuprofile != "" {
		stopProfile, err := startCPUProfile(o.cpuprofile)
		if err != nil {
			return err
		}
		defer stopProfile()
	}
	res, err := runBench(ctx, o, os.Stderr)
	if err != nil {
		return err
	}
	md, err := writeOutputs(o.out, res)
	if err != nil {
		return err
	}
	fmt.Print(md)
	fmt.Fprintf(os.Stderr, "wrote %s (results.md, results.json, plots) in %.0fs\n", o.out, res.Seconds)
	return nil
}

// rerender reads a results.json and writes its report and plots into out.
func rerender(from, out string) error {
	b, err := os.ReadFile(from)
	if err != nil {
		return err
	}
	var res Results
	if err := json.Unmarshal(b, &res); err != nil {
		return fmt.Errorf("%s: %w", from, err)
	}
	md, err := writeOutputs(out, &res)
	if err != nil {
		return err
	}
	fmt.Print(md)
	return nil
}

// runBench starts (or connects to) the server, runs the selected scenarios and
// returns every figure.
func runBench(ctx context.Context, o options, progressTo io.Writer) (*Results, error) {
	kinds, err := selectKinds(o.contenders)
	if err != nil {
		return nil, err
	}
	scen, err := selectScenarios(o.scenarios)
	if err != nil {
		return nil, err
	}
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	addr, own := o.addr, false
	if addr == "" {
		// In a session of its own, the server is scheduled as a Redis run as a
		// service would be, not as one more thread of the harness's session
		// (Linux autogroups); measured in B, leash and naive ran about 5 %
		// faster so and rueidislock the same (bench/RESULTS.md, What changed).
		srv, err := testredis.Start(testredis.WithOwnSession())
		if err != nil {
			return nil, err
		}
		defer srv.Stop()
		addr, own = srv.Addr(), true
	}
	stats, err := newRedisStats(ctx, addr)
	if err != nil {
		return nil, err
	}
	defer stats.close()
	machine, err := machineInfo(ctx, stats, addr, own, o.prof.Pings)
	if err != nil {
		return nil, err
	}
	r := &runner{
		prof:  o.prof,
		addr:  addr,
		stats: stats,
		kinds: kinds,
		scen:  scen,
		exe:   exe,
		rtt:   time.Duration(machine.RTT.P50us * float64(time.Microsecond)),
		res: &Results{
			Command:    "cd bench && go run . " + strings.Join(o.args, " "),
			Started:    time.Now(),
			Machine:    machine,
			Profile:    o.prof,
			Contenders: names(kinds),
		},
	}
	for _, s := range scenarioList {
		if scen[s.letter] {
			r.res.Scenarios = append(r.res.Scenarios, s.name)
		}
	}
	r.prog = newProgress(progressTo, r.cellCount())
	err = r.runAll(ctx)
	r.prog.finish()
	r.res.Seconds = time.Since(r.res.Started).Seconds()
	return r.res, err
}

// names returns the kinds' names.
func names(kinds []contenderKind) []string {
	out := make([]string, len(kinds))
	for i, k := range kinds {
		out[i] = k.name
	}
	return out
}

// runner runs the scenarios and collects Results.
type runner struct {
	prof  Profile
	addr  string
	stats *redisStats
	kinds []contenderKind
	scen  map[string]bool
	// exe is this binary, re-executed as scenario C's workers.
	exe string
	// rtt is the loopback round trip (PING p50).
	rtt  time.Duration
	prog *progress
	res  *Results
}

// hasLeash reports whether leash is among the selected contenders (F and G are
// leash-only).
func (r *runner) hasLeash() bool {
	return slices.ContainsFunc(r.kinds, func(k contenderKind) bool { return k.name == "leash" })
}

// cellCount returns how many cells the run has, for the progress line: one per
// contender and scenario (and goroutine count or process count) and repetition,
// a D cell counting once per round.
func (r *runner) cellCount() int {
	n := 0
	for _, k := range r.kinds {
		if r.scen["A"] && k.runsIn("A") {
			n += len(r.prof.AGoroutines)
		}
		if r.scen["B"] && k.runsIn("B") {
			n++
		}
		if r.scen["C"] && k.runsIn("C") {
			n += len(r.prof.CProcs)
		}
		if r.scen["D"] && k.runsIn("D") {
			rounds, _, _ := r.prof.dRound()
			n += rounds
		}
	}
	if r.hasLeash() && r.scen["F"] {
		n++
	}
	if r.hasLeash() && r.scen["G"] {
		n++
	}
	return n * r.prof.Reps
}

// runAll runs every repetition. A cell that fails is recorded in
// Results.Failures and the run goes on; only the context ending stops it.
func (r *runner) runAll(ctx context.Context) error {
	p := r.prof
	for rep := range p.Reps {
		order := rotate(r.kinds, rep)
		// The round trip drifts on a shared machine: measure it again each
		// repetition, for scenario C's physical limit and the report.
		rtt, err := pingRTT(ctx, r.stats.rdb, p.Pings)
		if err != nil {
			return err
		}
		r.res.RTTByRep = append(r.res.RTTByRep, rtt)
		r.rtt = time.Duration(rtt.P50us * float64(time.Microsecond))
		// cell runs one cell, unless the context has ended or k does not take part
		// in the scenario.
		cell := func(k contenderKind, letter, label string, f func() error) {
			if ctx.Err() != nil || !k.runsIn(letter) {
				return
			}
			r.prog.step(fmt.Sprintf("rep %d/%d  %s", rep+1, p.Reps, label))
			if err := f(); err != nil && ctx.Err() == nil {
				msg := fmt.Sprintf("rep %d %s: %v", rep+1, label, err)
				r.res.Failures = append(r.res.Failures, msg)
				r.prog.note("FAILED " + msg)
			}
		}
		if r.scen["A"] {
			for _, g := range p.AGoroutines {
				for _, k := range order {
					cell(k, "A", fmt.Sprintf("A contended  G=%d  %s", g, k.name), func() error {
						run, err := r.runA(ctx, k, g, rep)
						if err == nil {
							r.res.A = append(r.res.A, run)
						}
						return err
					})
				}
			}
		}
		if r.scen["B"] {
			for _, k := range order {
				cell(k, "B", "B uncontended  "+k.name, func() error {
					run, err := r.runB(ctx, k, rep)
					if err == nil {
						r.res.B = append(r.res.B, run)
					}
					return err
				})
			}
		}
		if r.scen["C"] {
			for _, procs := range p.CProcs {
				for _, k := range order {
					cell(k, "C", fmt.Sprintf("C many waiters  %d proc  %s", procs, k.name), func() error {
						run, err := r.runC(ctx, k, procs, rep)
						if err == nil {
							r.res.C = append(r.res.C, run)
						}
						return err
					})
				}
			}
		}
		if r.scen["D"] {
			r.runDRep(ctx, order, rep, func(k contenderKind, label string, f func() error) {
				cell(k, "D", label, f)
			})
		}
		if r.hasLeash() && r.scen["F"] {
			cell(leashKind(), "F", "F renewals  leash", func() error {
				run, err := r.runF(ctx, rep)
				if err == nil {
					r.res.F = append(r.res.F, run)
				}
				return err
			})
		}
		if r.hasLeash() && r.scen["G"] {
			cell(leashKind(), "G", "G memory per waiter  leash", func() error {
				run, err := r.runG(ctx, rep)
				if err == nil {
					r.res.G = append(r.res.G, run)
				}
				return err
			})
		}
	}
	return ctx.Err()
}
