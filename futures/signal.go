package futures

import "sync"

// Signal is a broadcast that happens once: its channel is closed exactly once and
// never sent on. The zero value is not usable; call NewSignal.
type Signal struct {
	ch   chan struct{}
	once sync.Once
}

// NewSignal returns a signal that has not fired.
func NewSignal() *Signal { return &Signal{ch: make(chan struct{})} }

// C returns a channel that is closed when Fire is first called, and never sent on.
func (s *Signal) C() <-chan struct{} { return s.ch }

// Fire closes the signal's channel. It is idempotent and never blocks.
func (s *Signal) Fire() { s.once.Do(func() { close(s.ch) }) }

// Fired reports whether Fire has been called.
func (s *Signal) Fired() bool {
	select {
	case <-s.ch:
		return true
	default:
		return false
	}
}

var fired = func() chan struct{} { c := make(chan struct{}); close(c); return c }()

// FiredC returns a channel that is already closed: the signal of something that has
// already happened (a Lost channel of a handle that holds nothing).
func FiredC() <-chan struct{} { return fired }
