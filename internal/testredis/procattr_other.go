//go:build !linux

package testredis

import "syscall"

// childAttrs has nothing to add outside Linux (WithOwnSession included).
func childAttrs(bool) *syscall.SysProcAttr { return nil }
