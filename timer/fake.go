package timer

import (
	"sort"
	"sync"
	"time"
)

// Fake is a manual Scheduler for tests: nothing fires until Advance moves its clock.
type Fake struct {
	mu      sync.Mutex
	now     time.Duration
	entries map[Key]time.Duration // key -> due time on the fake clock
	stopped bool
}

var _ Scheduler = (*Fake)(nil)

// NewFake returns a fake scheduler at time zero.
func NewFake() *Fake { return &Fake{entries: make(map[Key]time.Duration)} }

// Schedule implements Scheduler.
func (f *Fake) Schedule(key Key, d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.stopped {
		f.entries[key] = f.now + d
	}
}

// Cancel implements Scheduler.
func (f *Fake) Cancel(key Key) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.entries, key)
}

// Stop implements Scheduler.
func (f *Fake) Stop() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.stopped = true
	clear(f.entries)
}

// Advance moves the clock by d and returns the keys that came due, earliest first.
func (f *Fake) Advance(d time.Duration) []Key {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.now += d
	var due []Key
	for k, at := range f.entries {
		if at <= f.now {
			due = append(due, k)
			delete(f.entries, k)
		}
	}
	sort.Slice(due, func(i, j int) bool { return due[i].ID < due[j].ID })
	return due
}

// Armed reports whether key is armed, and its remaining time.
func (f *Fake) Armed(key Key) (time.Duration, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.entries[key]
	return at - f.now, ok
}
