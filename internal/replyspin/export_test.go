package replyspin

import "time"

// Average returns the running average reply time (zero before the first).
func (s *Spinner) Average() time.Duration { return time.Duration(s.avg.Load()) }

// Marked reports whether a call is marked now.
func (s *Spinner) Marked() bool { return s.cur.Load() != 0 }

// Polling reports how many polls are under way.
func (s *Spinner) Polling() int { return int(s.polling.Load()) }

// NewAnyCPU is New without its one-CPU rule, so the tests run on any machine.
func NewAnyCPU(max time.Duration) *Spinner { return &Spinner{max: max, epoch: time.Now()} }
