package timer

import (
	"sync"
	"time"

	"github.com/RussellLuo/timingwheel"
)

// Key identifies one scheduled entry. Its meaning belongs to the scheduler's user:
// Kind says what the entry is for, ID which object, Gen which incarnation of it.
type Key struct {
	Kind uint8
	ID   uint64
	Gen  uint64
}

// Scheduler arms and cancels entries by key. Implementations are safe for concurrent
// use and never block on the sink.
type Scheduler interface {
	// Schedule arms key to fire after d (at once if d <= 0), replacing any entry
	// already armed under the same key.
	Schedule(key Key, d time.Duration)
	// Cancel disarms key. A firing already on its way may still arrive.
	Cancel(key Key)
	// Stop disarms everything and stops the scheduler; later calls do nothing.
	Stop()
}

// Sink receives firings. It is called from the wheel's goroutines and must not block.
type Sink func(Key)

// Wheel is the production Scheduler.
//
// Caveats of the underlying wheel, and how Wheel handles them: it calls each expired
// task in a goroutine of its own (so the sink must be quick and non-blocking: the
// engine's sink appends to a batch and signals, so thousands of firings in one tick
// arrive as one batch and none is dropped); it reads the wall clock (so the engine
// re-checks every firing on the monotonic clock); and Stop does not wait for tasks
// already running (so the sink stays safe to call after Stop).
type Wheel struct {
	sink Sink

	mu      sync.Mutex
	wheel   *timingwheel.TimingWheel
	entries map[Key]*entry // armed entries, removed when they fire or are cancelled
	stopped bool
}

var _ Scheduler = (*Wheel)(nil)

// Tick is the wheel's resolution. Leases and waits are milliseconds in Redis too.
const Tick = time.Millisecond

// wheelSize buckets of one Tick each cover half a second at the lowest level; longer
// deadlines go to the overflow levels the wheel adds by itself.
const wheelSize = 512

// NewWheel starts a wheel that hands firings to sink.
func NewWheel(sink Sink) *Wheel {
	w := &Wheel{
		sink:    sink,
		wheel:   timingwheel.NewTimingWheel(Tick, wheelSize),
		entries: make(map[Key]*entry),
	}
	w.wheel.Start()
	return w
}

// Schedule implements Scheduler.
func (w *Wheel) Schedule(key Key, d time.Duration) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped {
		return
	}
	if old := w.entries[key]; old != nil {
		old.t.Stop()
	}
	e := &entry{}
	w.entries[key] = e
	// The task may run before AfterFunc returns; it identifies its entry by the
	// pointer e, which is complete before the wheel sees the task.
	e.t = w.wheel.AfterFunc(d, func() { w.fire(key, e) })
}

// entry is one armed key; its identity tells a firing of a replaced entry apart.
type entry struct{ t *timingwheel.Timer }

func (w *Wheel) fire(key Key, e *entry) {
	w.mu.Lock()
	if w.entries[key] == e {
		delete(w.entries, key)
	}
	w.mu.Unlock()
	w.sink(key)
}

// Cancel implements Scheduler.
func (w *Wheel) Cancel(key Key) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if e := w.entries[key]; e != nil {
		e.t.Stop()
		delete(w.entries, key)
	}
}

// Stop implements Scheduler. It waits for the wheel's own goroutines to end.
func (w *Wheel) Stop() {
	w.mu.Lock()
	if w.stopped {
		w.mu.Unlock()
		return
	}
	w.stopped = true
	for k, e := range w.entries {
		e.t.Stop()
		delete(w.entries, k)
	}
	w.mu.Unlock()
	w.wheel.Stop()
}

// Len returns how many entries are armed (for tests and metrics).
func (w *Wheel) Len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.entries)
}
