package lockapi_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// stormLockTracker checks mutual exclusion on one lock between handles. A handle may
// be inside several times (shared by goroutines). An insider whose Lost is closed
// does not count (its hold may be gone on the server).
type stormLockTracker struct {
	mu    sync.Mutex
	in    map[*lockapi.Mutex][]*stormInsider
	epoch map[*lockapi.Mutex]int // bumped at each failed Unlock of the handle
	// tainted: when Unlocks of each handle started whose caller's hold had been
	// lost by the time they returned. Such an Unlock may release the hold another
	// goroutine of the handle took since (documented: the handle cannot tell its
	// goroutines apart), so an entry that follows it is no violation.
	tainted  map[*lockapi.Mutex][]time.Time
	suspects []stormSuspect
}

type stormInsider struct {
	lost      <-chan struct{}
	label     string
	lockStart time.Time // when its Lock was called
	at        time.Time
	epoch     int // the handle's epoch before the Lock
}

// stormSuspect is an entry while another handle's goroutine was inside, judged at
// the end (check): a tainted Unlock of the insider's handle may excuse it.
type stormSuspect struct {
	handle *lockapi.Mutex
	since  time.Time // the insider's Lock call
	at     time.Time
	what   string
}

type stormTracker struct {
	dataLoss bool // the server loses its data (restarts): mutual exclusion is not owed
	errsMu   sync.Mutex
	errs     map[string]int
	locks    []*stormLockTracker
	mu       sync.Mutex
	problems []string
	excused  atomic.Int64
}

func newStormTracker(n int) *stormTracker {
	tr := &stormTracker{}
	for range n {
		tr.locks = append(tr.locks, &stormLockTracker{in: map[*lockapi.Mutex][]*stormInsider{},
			epoch: map[*lockapi.Mutex]int{}, tainted: map[*lockapi.Mutex][]time.Time{}})
	}
	return tr
}

// note counts an error a fault may explain, by its text. A NOSCRIPT reply is
// never one: the scripts are loaded again and the calls re-sent (scripts.RunBatch),
// so a caller must never see it.
func (tr *stormTracker) note(what string, err error) {
	if strings.Contains(err.Error(), "NOSCRIPT") {
		tr.errorf("%s: a NOSCRIPT reply reached the caller: %v", what, err)
	}
	tr.errsMu.Lock()
	if tr.errs == nil {
		tr.errs = map[string]int{}
	}
	tr.errs[what+": "+err.Error()]++
	tr.errsMu.Unlock()
}

func (tr *stormTracker) errorf(format string, args ...any) {
	tr.mu.Lock()
	tr.problems = append(tr.problems, time.Now().Format("05.000000")+" "+fmt.Sprintf(format, args...))
	tr.mu.Unlock()
}

// epoch returns m's epoch on lock li: read it before a Lock.
func (tr *stormTracker) epoch(li int, m *lockapi.Mutex) int {
	lt := tr.locks[li]
	lt.mu.Lock()
	defer lt.mu.Unlock()
	return lt.epoch[m]
}

// bump records a failed Unlock of m: a goroutine of a shared handle that is inside
// then may hold nothing (the hold it was granted was lost, and Lost, asked for
// after its Lock, may be a newer hold's).
func (tr *stormTracker) bump(li int, m *lockapi.Mutex) {
	lt := tr.locks[li]
	lt.mu.Lock()
	lt.epoch[m]++
	lt.mu.Unlock()
}

// taint records an Unlock of m on lock li that started at start and returned with
// its caller's Lost closed.
func (tr *stormTracker) taint(li int, m *lockapi.Mutex, start time.Time) {
	lt := tr.locks[li]
	lt.mu.Lock()
	lt.tainted[m] = append(lt.tainted[m], start)
	lt.mu.Unlock()
}

// enter records a goroutine inside lock li through handle m, whose Lock was
// called at lockStart, and returns its record, for exit.
func (tr *stormTracker) enter(li int, m *lockapi.Mutex, lost <-chan struct{}, label string, epoch int, lockStart time.Time) *stormInsider {
	lt := tr.locks[li]
	lt.mu.Lock()
	defer lt.mu.Unlock()
	if isClosed(lost) {
		// Its hold is gone already (an early grant whose handoff then failed): it
		// does not count, as an insider whose Lost closed does not.
		tr.excused.Add(1)
	}
	for o, ins := range lt.in {
		if tr.dataLoss || isClosed(lost) {
			break
		}
		if o == m {
			continue
		}
		for _, in := range ins {
			if isClosed(in.lost) || in.epoch != lt.epoch[o] {
				tr.excused.Add(1)
				continue
			}
			now := time.Now()
			lt.suspects = append(lt.suspects, stormSuspect{handle: o, since: in.lockStart, at: now,
				what: fmt.Sprintf("%s lock %d: %s entered while %s was inside (since %s) with its Lost open",
					now.Format("05.000000"), li, label, in.label, in.at.Format("05.000000"))})
		}
	}
	in := &stormInsider{lost: lost, label: label, lockStart: lockStart, at: time.Now(), epoch: epoch}
	lt.in[m] = append(lt.in[m], in)
	return in
}

// exit removes the record enter returned. Goroutines sharing a handle leave in
// any order: the record left must be the one still inside, whose Lost and epoch
// are its own.
func (tr *stormTracker) exit(li int, m *lockapi.Mutex, in *stormInsider) {
	lt := tr.locks[li]
	lt.mu.Lock()
	lt.in[m] = slices.DeleteFunc(lt.in[m], func(x *stormInsider) bool { return x == in })
	if len(lt.in[m]) == 0 {
		delete(lt.in, m)
	}
	lt.mu.Unlock()
}

func (tr *stormTracker) check(t *testing.T) {
	t.Helper()
	for _, lt := range tr.locks {
		lt.mu.Lock()
		for _, s := range lt.suspects {
			excused := slices.ContainsFunc(lt.tainted[s.handle], func(at time.Time) bool {
				return !at.Before(s.since) && !at.After(s.at)
			})
			if excused {
				tr.excused.Add(1)
				continue
			}
			tr.mu.Lock()
			tr.problems = append(tr.problems, s.what)
			tr.mu.Unlock()
		}
		lt.suspects = nil
		lt.mu.Unlock()
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	reportProblems(t, tr.problems, 15)
}

// stormFaults names the faults a storm injects.
type stormFaults struct {
	scriptFlush bool
	killNormal  bool
	killPubSub  bool
	pause       bool // SIGSTOP for a few ms
	restart     bool // kill the server and start it again, empty (data loss: no exclusion check)
	fixed       bool // faults exactly every faultEvery, not at random intervals up to it
}

// stormInject runs faults on srv until stop is closed, at random intervals of up to
// every (exactly every, with f.fixed). Wait on the returned group after closing
// stop.
func stormInject(t *testing.T, srv *testredis.Server, f stormFaults, every time.Duration, stop <-chan struct{}) *sync.WaitGroup {
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			d := time.Duration(rand.Int64N(int64(every)) + 1)
			if f.fixed {
				d = every
			}
			select {
			case <-stop:
				return
			case <-time.After(d):
			}
			var kinds []string
			if f.scriptFlush {
				kinds = append(kinds, "flush")
			}
			if f.killNormal {
				kinds = append(kinds, "normal")
			}
			if f.killPubSub {
				kinds = append(kinds, "pubsub")
			}
			if f.pause {
				kinds = append(kinds, "pause")
			}
			if f.restart {
				kinds = append(kinds, "restart")
			}
			var err error
			switch kinds[rand.IntN(len(kinds))] {
			case "flush":
				_, err = srv.Do("SCRIPT", "FLUSH")
			case "normal":
				_, err = srv.Do("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
			case "pubsub":
				_, err = srv.Do("CLIENT", "KILL", "TYPE", "pubsub")
			case "restart":
				if err = srv.Kill(); err == nil {
					time.Sleep(time.Duration(rand.IntN(50)) * time.Millisecond) // the outage itself is the fault
					err = srv.Restart()
				}
			case "pause":
				if err = srv.Pause(); err == nil {
					time.Sleep(time.Duration(rand.IntN(20)) * time.Millisecond) // the pause itself is the fault
					err = srv.Resume()
				}
			}
			if err != nil {
				t.Errorf("fault: %v", err)
				return
			}
		}
	})
	return &wg
}

// stormConfig configures runStorm.
type stormConfig struct {
	clients, locks, goroutines int
	shared                     bool // goroutines of one client share one handle per lock
	faults                     stormFaults
	faultEvery                 time.Duration
	dur                        time.Duration
	opts                       lockapi.Options
	closeOne                   bool // close client 0 mid-storm
	checkHoldCount             bool
	fair                       bool // FairMutex handles
}

// runStorm: goroutines on many locks in several clients take a random lock in a
// random way (Lock with a context ending at a random moment, TryLock, Acquire and
// walk away, sometimes re-entering), and release it, while faults hit the server.
// No two handles are inside one lock together (unless one's Lost is closed), every
// call returns within a bound, Unlock errors are only what faults explain, and at
// the end every client settles, every key is gone and no lock channel is
// subscribed.
func runStorm(t *testing.T, cfg stormConfig) {
	srv := testredis.New(t)
	var names, channels []string
	for i := range cfg.locks {
		n := lockName(t, strconv.Itoa(i))
		names = append(names, n)
		channels = append(channels, engine.ChannelName(n))
	}
	var cs []*lockapi.Client
	for range cfg.clients {
		cs = append(cs, newClient(t, srv, cfg.opts))
	}
	faulty := cfg.faults != (stormFaults{})
	tr := newStormTracker(cfg.locks)
	tr.dataLoss = cfg.faults.restart
	var closing atomic.Bool
	var acquired, ctxErrs, unlockErrs, lockErrs atomic.Int64
	var perG = make([]atomic.Int64, cfg.goroutines)

	// When shared, goroutines g and g+clients (same client) share their handles:
	// two goroutines per handle, so its count often drops to zero (a handle shared
	// by many goroutines would re-enter forever and starve the other clients).
	pairHandles := map[int][]*lockapi.Mutex{} // by the goroutine that takes them
	stop := make(chan struct{})
	var stopOnce sync.Once
	stopAll := func() { stopOnce.Do(func() { close(stop) }) }
	var wg sync.WaitGroup
	// On a failure, stop the goroutines and wait for them (they must not outlive
	// the test).
	defer func() {
		stopAll()
		wg.Wait()
	}()
	for g := range cfg.goroutines {
		ci := g % cfg.clients
		c := cs[ci]
		own := make([]*lockapi.Mutex, cfg.locks)
		for li := range own {
			switch {
			case cfg.shared && (g/cfg.clients)%2 == 1:
				own[li] = pairHandles[g][li]
			default:
				own[li] = stormMutex(c, names[li], cfg.fair)
			}
		}
		if cfg.shared && (g/cfg.clients)%2 == 0 {
			pairHandles[g+cfg.clients] = own
		}
		wg.Go(func() {
			defer func() {
				if r := recover(); r != nil {
					tr.errorf("g%d panicked: %v", g, r)
				}
			}()
			for {
				select {
				case <-stop:
					return
				default:
				}
				li := rand.IntN(cfg.locks)
				m := own[li]
				t0 := time.Now()
				ep := tr.epoch(li, m)
				held, how, err := advLockOnce(m) // one way or another, chosen at random
				// A Lock returns within its context plus one OpTimeout (a call at the
				// server is waited for); a generous bound on a loaded machine.
				if d := time.Since(t0); d > 25*time.Second {
					tr.errorf("g%d %s took %v (err %v)", g, how, d, err)
				}
				if err != nil {
					if cfg.checkHoldCount && !cfg.shared && !faulty && !(ci == 0 && closing.Load()) {
						// A walked-away Acquire's grant is taken back once the engine
						// hears of the context's end (context.AfterFunc): allow it a
						// moment. A Lock or TryLock that returned an error holds
						// nothing at once.
						wait := time.Duration(0)
						if how == "Acquire" {
							wait = 2 * time.Second
						}
						start := time.Now()
						for {
							hctx, hcancel := context.WithTimeout(context.Background(), 20*time.Second)
							n, herr := m.HoldCount(hctx)
							hcancel()
							if herr == nil && n == 0 {
								break
							}
							if time.Since(start) >= wait {
								// What the server has, for whoever looks into it: the
								// fields are "<client id>:<owner id>". (srv.Do, not do:
								// this goroutine may not end the test.)
								n0 := names[li]
								raw := func(args ...string) string {
									got, err := srv.Do(args...)
									if err != nil {
										return err.Error()
									}
									return got
								}
								tr.errorf("g%d lock %d: %s failed (%v), yet HoldCount = %d, %v (after %v); handle's field %s; server: HGETALL %q, queue %q, timeouts %q",
									g, li, how, err, n, herr, time.Since(start), stormField(c, m), raw("HGETALL", n0),
									raw("LRANGE", "redisson_lock_queue:{"+n0+"}", "0", "-1"),
									raw("ZRANGE", "redisson_lock_timeout:{"+n0+"}", "0", "-1", "WITHSCORES"))
								break
							}
							time.Sleep(time.Millisecond) // polling
						}
					}
					switch {
					case isCtxErr(err):
						ctxErrs.Add(1)
					case errors.Is(err, lockapi.ErrClosed) && ci == 0 && closing.Load():
						return
					case faulty && !errors.Is(err, lockapi.ErrInvalidArgument):
						lockErrs.Add(1) // a transport error after retries
						tr.note(how, err)
					default:
						tr.errorf("g%d %s: %v", g, how, err)
					}
					continue
				}
				if !held {
					continue
				}
				lost := m.Lost()
				in := tr.enter(li, m, lost, fmt.Sprintf("c%d g%d %s (field %s)", ci, g, how, stormField(c, m)), ep, t0)
				acquired.Add(1)
				perG[g].Add(1)
				depth := 1
				// Sometimes re-enter, with a context that may end at any moment.
				if rand.IntN(4) == 0 {
					ctx, cancel := stressLockCtx()
					err := m.Lock(ctx)
					cancel()
					switch {
					case err == nil:
						depth++
					case isCtxErr(err):
					case errors.Is(err, lockapi.ErrClosed) && ci == 0 && closing.Load():
					case faulty:
						lockErrs.Add(1)
						tr.note("re-entry", err)
					default:
						tr.errorf("g%d re-entry after %s: %v", g, how, err)
					}
				}
				if cfg.checkHoldCount && !cfg.shared && !(ci == 0 && closing.Load()) {
					hctx, hcancel := context.WithTimeout(context.Background(), 20*time.Second)
					n, err := m.HoldCount(hctx)
					hcancel()
					if err == nil && n != depth && !isClosed(lost) && !faulty {
						tr.errorf("g%d lock %d after %s: HoldCount %d, want %d", g, li, how, n, depth)
					}
				}
				for range rand.IntN(20) {
					runtime.Gosched()
				}
				if isClosed(lost) && !faulty && !(ci == 0 && closing.Load()) {
					tr.errorf("g%d lock %d after %s: Lost closed while inside", g, li, how)
				}
				tr.exit(li, m, in)
				for range depth {
					uctx, ucancel := unlockCtx()
					t1 := time.Now()
					err := m.Unlock(uctx)
					ucancel()
					if err != nil {
						tr.bump(li, m)
					}
					if isClosed(lost) {
						tr.taint(li, m, t1)
					}
					if d := time.Since(t1); d > 20*time.Second {
						tr.errorf("g%d Unlock took %v (err %v)", g, d, err)
					}
					switch {
					case err == nil:
					case ci == 0 && closing.Load() && (errors.Is(err, lockapi.ErrClosed) || errors.Is(err, lockapi.ErrNotHeld)):
						return
					case faulty:
						unlockErrs.Add(1)
						tr.note("Unlock", err)
					default:
						tr.errorf("g%d lock %d Unlock after %s: %v", g, li, how, err)
					}
				}
			}
		})
	}
	fstop := make(chan struct{})
	var fwg *sync.WaitGroup
	if faulty {
		fwg = stormInject(t, srv, cfg.faults, cfg.faultEvery, fstop)
	}
	var fstopOnce sync.Once
	defer fstopOnce.Do(func() { close(fstop) })
	if cfg.closeOne {
		time.Sleep(cfg.dur / 2) // the storm's first half is the point, not a wait for state
		closing.Store(true)
		start := time.Now()
		cs[0].Close()
		if d := time.Since(start); d > 15*time.Second {
			t.Errorf("Close took %v", d)
		}
		time.Sleep(cfg.dur / 2)
	} else {
		time.Sleep(cfg.dur) // the storm's length
	}
	fstopOnce.Do(func() { close(fstop) })
	if fwg != nil {
		fwg.Wait()
	}
	base := make([]int64, cfg.goroutines)
	for g := range base {
		base[g] = perG[g].Load()
	}
	// After the faults, every goroutine of a live client still gets locks.
	// LEASH_STORM_RECOVER (a duration) shortens the wait, to see the state of a stuck
	// storm sooner.
	recoverWithin := 20 * time.Second
	if v := os.Getenv("LEASH_STORM_RECOVER"); v != "" {
		recoverWithin, _ = time.ParseDuration(v)
	}
	deadline := time.Now().Add(recoverWithin)
	for {
		var behind []int
		for g := range base {
			if cfg.closeOne && g%cfg.clients == 0 || cfg.shared {
				// A handle shared by two goroutines may hold for as long as they
				// take turns re-entering it (neither waits for the other): no
				// progress is owed to anyone else then.
				continue
			}
			if perG[g].Load() < base[g]+2 {
				behind = append(behind, g)
			}
		}
		if len(behind) == 0 {
			break
		}
		if time.Now().After(deadline) {
			tr.check(t)
			for ci, c := range cs {
				if cfg.closeOne && ci == 0 {
					continue
				}
				t.Logf("client %d (%s) stats: %+v", ci, c.ID(), stats(t, c))
			}
			for _, n := range names {
				t.Logf("%s", lockServerState(t, srv, n))
				for ci, c := range cs {
					if !(cfg.closeOne && ci == 0) {
						t.Logf("client %d: %s", ci, lockapi.DescribeLock(c, n))
					}
				}
			}
			t.Logf("keys: %q", do(t, srv, "KEYS", "*"))
			tr.errsMu.Lock()
			for e, n := range tr.errs {
				t.Logf("%dx %s", n, e)
			}
			tr.errsMu.Unlock()
			t.Logf("pubsub channels: %q", do(t, srv, "PUBSUB", "CHANNELS", "*"))
			t.Fatalf("goroutines %v acquired fewer than 2 times in %v after the faults", behind, recoverWithin)
		}
		time.Sleep(5 * time.Millisecond) // polling a condition
	}
	stopAll()
	stressWait(t, &wg, 60*time.Second, "the storm's goroutines")
	tr.check(t)
	live := cs
	if cfg.closeOne {
		live = cs[1:]
	}
	clientsSettled(t, live...)
	keysGone := time.Now().Add(15 * time.Second)
	for do(t, srv, "DBSIZE") != "0" {
		if time.Now().After(keysGone) {
			for _, n := range names {
				t.Logf("%s: HGETALL %q PTTL %s", n, do(t, srv, "HGETALL", n), do(t, srv, "PTTL", n))
			}
			for ci, c := range live {
				t.Logf("client %d (%s) stats: %+v", ci, c.ID(), stats(t, c))
			}
			tr.errsMu.Lock()
			for e, n := range tr.errs {
				t.Logf("%dx %s", n, e)
			}
			tr.errsMu.Unlock()
			t.Fatalf("keys left 15 s after the storm: %q", do(t, srv, "KEYS", "*"))
		}
		time.Sleep(5 * time.Millisecond) // polling
	}
	eventually(t, 5*time.Second, "no lock channel or pattern to stay subscribed", func() bool {
		for _, ch := range channels {
			if numSub(t, srv, ch) != "0" {
				return false
			}
		}
		return do(t, srv, "PUBSUB", "NUMPAT") == "0"
	})
	for e, n := range tr.errs {
		t.Logf("%dx %s", n, e)
	}
	t.Logf("%d acquisitions, %d ctx errors, %d lock errors, %d unlock errors, %d excused", acquired.Load(), ctxErrs.Load(), lockErrs.Load(), unlockErrs.Load(), tr.excused.Load())
}

// stormField returns m's own owner field (a hold from a direct grant is under
// another field).
func stormField(c *lockapi.Client, m *lockapi.Mutex) string {
	return engine.OwnerField(c.ID(), stormOwner(m))
}

// The engine numbers a client's handles 1, 2, ... in creation order (NewOwner);
// stormMutex makes a handle and remembers its number, for reports.
var (
	stormOwners   sync.Map // *lockapi.Mutex -> uint64
	stormCountsMu sync.Mutex
	stormCounts   = map[*lockapi.Client]uint64{}
)

func stormMutex(c *lockapi.Client, name string, fair bool) *lockapi.Mutex {
	stormCountsMu.Lock()
	defer stormCountsMu.Unlock()
	var m *lockapi.Mutex
	if fair {
		m = c.FairMutex(name)
	} else {
		m = c.Mutex(name) // not both: each handle takes a number
	}
	stormCounts[c]++
	stormOwners.Store(m, stormCounts[c])
	return m
}

func stormOwner(m *lockapi.Mutex) uint64 {
	v, _ := stormOwners.Load(m)
	n, _ := v.(uint64)
	return n
}

// TestFaultStormScriptFlush runs runStorm while SCRIPT FLUSH empties the server's
// script cache every few milliseconds. A flush between scripts.RunBatch's reload
// and its re-send made the re-sent EVALSHA answer NOSCRIPT, which reached the
// engine as a Redis error: Lock and Unlock returned it, a failed Unlock counted
// the hold as lost, and the lock stayed held, by nobody, until its lease ended.
// RunBatch now sends again while it meets NOSCRIPT (up to maxNoScriptTries).
//
// Not parallel: a storm keeps both cores busy, and the parallel tests' wall-clock
// sanity bounds (2 s for a Lock in the adv storms) fail beside it.
func TestFaultStormScriptFlush(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  stormConfig
	}{
		{"flush", stormConfig{clients: 2, locks: 6, goroutines: 48, dur: 3 * time.Second,
			faults: stormFaults{scriptFlush: true}, faultEvery: 20 * time.Millisecond, checkHoldCount: true,
			opts: lockapi.Options{WatchdogTimeout: 2 * time.Second}}},
		{"flush-shared", stormConfig{clients: 3, locks: 6, goroutines: 48, dur: 3 * time.Second, shared: true,
			faults: stormFaults{scriptFlush: true}, faultEvery: 30 * time.Millisecond,
			opts: lockapi.Options{WatchdogTimeout: 2 * time.Second, OpTimeout: 2 * time.Second}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runStorm(t, tc.cfg)
		})
	}
}

// TestFaultStormKillSharedHandles runs runStorm with handles shared by two
// goroutines while CLIENT KILL cuts the clients' command connections every few
// milliseconds. It found that an Unlock parked behind the owner's call in flight
// released whatever hold the owner had when it ran: one goroutine's hold was
// lost, the other goroutine of the handle took the lock again, and the first
// one's Unlock then released that new hold, with its taker inside and its Lost
// open (1 run in 4). An Unlock is now bound to the hold it finds when it arrives
// (onUnlock).
//
// Not parallel, as TestFaultStormScriptFlush.
func TestFaultStormKillSharedHandles(t *testing.T) {
	runStorm(t, stormConfig{clients: 3, locks: 6, goroutines: 48, dur: 3 * time.Second, shared: true,
		faults: stormFaults{killNormal: true}, faultEvery: 30 * time.Millisecond,
		opts: lockapi.Options{WatchdogTimeout: 2 * time.Second, OpTimeout: 2 * time.Second}})
}

// TestFaultStorm runs runStorm under one kind of fault at a time, and none, for
// both lock kinds, private and shared handles, many locks, and a client closed
// mid-storm.
//
// Not parallel, as TestFaultStormScriptFlush: about 45 s.
func TestFaultStorm(t *testing.T) {
	faultOpts := lockapi.Options{WatchdogTimeout: 2 * time.Second, OpTimeout: 2 * time.Second}
	for _, tc := range []struct {
		name string
		cfg  stormConfig
	}{
		{"clean", stormConfig{clients: 2, locks: 6, goroutines: 48, dur: 2 * time.Second, checkHoldCount: true}},
		{"clean-shared", stormConfig{clients: 2, locks: 4, goroutines: 32, shared: true, dur: 2 * time.Second}},
		{"clean-fair", stormConfig{clients: 2, locks: 4, goroutines: 32, dur: 2 * time.Second, checkHoldCount: true, fair: true}},
		{"clean-shared-fair", stormConfig{clients: 2, locks: 4, goroutines: 32, shared: true, dur: 2 * time.Second, fair: true}},
		{"big", stormConfig{clients: 1, locks: 32, goroutines: 256, dur: 2 * time.Second, checkHoldCount: true}},
		{"killnormal", stormConfig{clients: 2, locks: 6, goroutines: 48, dur: 2 * time.Second,
			faults: stormFaults{killNormal: true}, faultEvery: 50 * time.Millisecond, opts: faultOpts}},
		{"killnormal-3clients", stormConfig{clients: 3, locks: 6, goroutines: 48, dur: 2 * time.Second,
			faults: stormFaults{killNormal: true}, faultEvery: 30 * time.Millisecond, opts: faultOpts}},
		{"killpubsub", stormConfig{clients: 2, locks: 6, goroutines: 48, dur: 2 * time.Second,
			faults: stormFaults{killPubSub: true}, faultEvery: 20 * time.Millisecond}},
		{"flush-rare", stormConfig{clients: 2, locks: 6, goroutines: 48, dur: 2 * time.Second,
			faults: stormFaults{scriptFlush: true, fixed: true}, faultEvery: 100 * time.Millisecond, checkHoldCount: true}},
		{"big-flush-every-250ms", stormConfig{clients: 2, locks: 32, goroutines: 256, dur: 2 * time.Second, checkHoldCount: true,
			faults: stormFaults{scriptFlush: true, fixed: true}, faultEvery: 250 * time.Millisecond}},
		{"close-clean", stormConfig{clients: 2, locks: 4, goroutines: 32, dur: 2 * time.Second, closeOne: true,
			opts: lockapi.Options{CloseTimeout: 2 * time.Second}}},
		{"close-flush-rare", stormConfig{clients: 2, locks: 4, goroutines: 32, dur: 2 * time.Second, closeOne: true,
			faults: stormFaults{scriptFlush: true, fixed: true}, faultEvery: 150 * time.Millisecond,
			opts: lockapi.Options{CloseTimeout: 2 * time.Second}}},
		{"killpubsub-fair", stormConfig{clients: 2, locks: 4, goroutines: 32, dur: 2 * time.Second, fair: true,
			faults: stormFaults{killPubSub: true}, faultEvery: 20 * time.Millisecond}},
		{"killnormal-shared-fair", stormConfig{clients: 3, locks: 4, goroutines: 36, dur: 2 * time.Second, shared: true, fair: true,
			faults: stormFaults{killNormal: true}, faultEvery: 30 * time.Millisecond, opts: faultOpts}},
		{"close-killpubsub", stormConfig{clients: 2, locks: 4, goroutines: 32, dur: 2 * time.Second, closeOne: true,
			faults: stormFaults{killPubSub: true}, faultEvery: 20 * time.Millisecond,
			opts: lockapi.Options{CloseTimeout: 2 * time.Second}}},
		{"restart", stormConfig{clients: 2, locks: 6, goroutines: 48, dur: 2 * time.Second,
			faults: stormFaults{restart: true}, faultEvery: 700 * time.Millisecond,
			opts: lockapi.Options{WatchdogTimeout: time.Second, OpTimeout: time.Second}}},
		{"pause", stormConfig{clients: 2, locks: 6, goroutines: 48, dur: 2 * time.Second,
			faults: stormFaults{pause: true}, faultEvery: 100 * time.Millisecond,
			opts: lockapi.Options{WatchdogTimeout: time.Second, OpTimeout: time.Second}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runStorm(t, tc.cfg)
		})
	}
}
